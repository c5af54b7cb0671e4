"""Worker-side env plumbing: pairs apply their env, the next item restores it, pills pass."""

from __future__ import annotations

import os
import queue
import subprocess
import sys

import pytest

from gpusched.airflow.dispatch import EnvApplyingQueue, apply_env, restore_env


def test_apply_and_restore() -> None:
    environ = {"KEEP": "1", "CUDA_VISIBLE_DEVICES": "old"}
    previous = apply_env({"CUDA_VISIBLE_DEVICES": "0,1", "NEW": "x"}, environ)
    assert environ == {"KEEP": "1", "CUDA_VISIBLE_DEVICES": "0,1", "NEW": "x"}
    restore_env(previous, environ)
    assert environ == {"KEEP": "1", "CUDA_VISIBLE_DEVICES": "old"}


def test_queue_applies_env_per_workload_and_clears_it_for_the_next() -> None:
    inner: queue.SimpleQueue[object] = queue.SimpleQueue()
    environ: dict[str, str] = {"PATH": "/bin"}
    reader = EnvApplyingQueue(inner, environ)
    inner.put(("gpu-workload", {"CUDA_VISIBLE_DEVICES": "4,5", "GPUSCHED_ALLOCATION": "{}"}))
    inner.put("plain-workload")
    inner.put(("gpu-2", {"CUDA_VISIBLE_DEVICES": "7"}))
    inner.put(None)

    assert reader.get() == "gpu-workload"
    assert environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert reader.get() == "plain-workload"
    assert environ == {"PATH": "/bin"}
    assert reader.get() == "gpu-2"
    assert environ == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "7"}
    assert reader.get() is None  # the poison pill passes through, env cleared first
    assert environ == {"PATH": "/bin"}


def test_a_tuple_workload_without_env_mapping_is_not_unpacked() -> None:
    inner: queue.SimpleQueue[object] = queue.SimpleQueue()
    inner.put(("a", "b"))
    assert EnvApplyingQueue(inner, {}).get() == ("a", "b")


def test_child_process_inherits_the_applied_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    inner: queue.SimpleQueue[object] = queue.SimpleQueue()
    inner.put(("w", {"CUDA_VISIBLE_DEVICES": "2,3"}))
    inner.put("next")
    reader = EnvApplyingQueue(inner)
    reader.get()
    code = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))"
    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == "2,3"
    reader.get()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ

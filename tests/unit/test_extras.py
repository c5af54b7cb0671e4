"""The ``lab`` extra (gpusched.extras): a missing optional dependency is one line naming the fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpusched.cli import main
from gpusched.errors import ConfigurationError, MissingExtraError
from gpusched.extras import LAB_FIX, LAB_PACKAGES, lab_module, pyplot

FIX_LINE = "matplotlib is not installed; it comes with gpusched's lab extra: pip install 'gpusched[lab]'"


@pytest.mark.parametrize("name", LAB_PACKAGES)
def test_a_missing_lab_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # import of it fails as if it were not installed
    with pytest.raises(MissingExtraError) as caught:
        lab_module(name)
    message = str(caught.value)
    assert message.startswith(f"{name} is not installed") and message.endswith(LAB_FIX)
    assert "\n" not in message and isinstance(caught.value, ConfigurationError)


def test_a_broken_package_is_not_reported_as_a_missing_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lab_pkg_needing_more.py").write_text("import gpusched_no_such_module\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="gpusched_no_such_module"):
        lab_module("lab_pkg_needing_more")


def test_pyplot_draws_to_files_only() -> None:
    assert pyplot().get_backend().lower() == "agg"


def test_a_lab_command_without_the_extra_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    latency = tmp_path / "latency"
    latency.mkdir()
    (latency / "latency.json").write_text(json.dumps({"policy": "gpusched", "sweep": []}), encoding="utf-8")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "report", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"gpusched bench report: error: {FIX_LINE}\n"

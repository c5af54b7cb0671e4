"""The fault chain's words for a try the executor failed as never fitting: one line, said once."""

from __future__ import annotations

from gpusched.faults.classify import FailureKind, classify_failure
from gpusched.faults.remedies import choose_remedy
from gpusched.model import FleetSnapshot
from gpusched.request import GPURequest
from gpusched.testing import synthetic_fleet


def test_a_long_never_fit_reason_is_kept_once_and_cut_only_at_a_word_boundary() -> None:
    """Before: the evidence kept the log's prefix, was cut at 300 characters mid-word, and the
    remedy's reason nested it once more on every refused retry."""
    reason = ("can never fit this fleet: needs 64 island-connected NVIDIA GPUs; " + "the largest matching "
              "island in the fleet has 8 devices, " * 12 + "so no placement holds it")
    # The try's log (the executor's line) and the listener's error text: the same reason twice.
    log = f"Could not read served logs\ngpusched: not started, {reason}\n{reason}"
    verdict = classify_failure(log)
    assert verdict.kind is FailureKind.UNSCHEDULABLE and len(verdict.evidence) == 1
    (said,) = verdict.evidence
    assert said.startswith("can never fit this fleet: needs 64") and said.endswith("…") and len(said) <= 300
    assert reason.startswith(said[:-1]) and reason[len(said) - 1] == " "  # a whole word before the cut
    remedy = choose_remedy(verdict, GPURequest.build(gpus=64, interconnect="island"), (),
                           FleetSnapshot(synthetic_fleet(2).nodes), attempt=3)
    assert not remedy.retry and "\n" not in remedy.reason
    assert remedy.reason == (f"unschedulable ({said}); not retrying: change the task's GPU request or add "
                             "matching hardware, then clear the task")
    assert classify_failure(f"gpusched: not started, {reason[:120]}").evidence == (reason[:120],)

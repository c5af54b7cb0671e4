"""How many GPUs a fleet has: every surface counts physical GPUs the same way (model.gpu_cards)."""

from __future__ import annotations

from pathlib import Path

from gpusched.fleetfile import load_fleet
from gpusched.model import gpu_cards

DEFAULT = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets" / "default.yaml"


def test_gpu_cards_count_a_sliced_gpu_once_however_it_is_recorded() -> None:
    devices = [d for n in load_fleet(DEFAULT) for d in n.devices]
    # The records: whole GPUs, a MIG-enabled A100 beside its instances, CPX partitions of an MI300X.
    assert len(devices) == 62
    assert gpu_cards(devices) == (51, 12)  # what the fleet page draws: 51 tiles, 12 slices inside them
    assert gpu_cards([d for d in devices if d.parent is None]) == (50, 0)

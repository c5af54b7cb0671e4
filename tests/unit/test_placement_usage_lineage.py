"""A cycle snapshot derived from the last one (``FleetSnapshot.retaken`` with ``changed``) gets
placement's usage arrays from the earlier snapshot's, rewritten on the changed devices only:
they must equal the arrays built from the whole usage."""

from __future__ import annotations

import random

import numpy as np

from gpusched.model import DeviceUsage
from gpusched.placement import index as placement_index
from gpusched.placement.index import fleet_index, usage_arrays
from gpusched.testing import synthetic_fleet


def test_derived_snapshots_give_the_arrays_of_their_whole_usage() -> None:
    rng = random.Random(3)
    snapshot = synthetic_fleet(50, seed=3)
    index = fleet_index(snapshot)
    usage_arrays(index, snapshot)  # the first one is built from its whole usage and cached
    uuids = [d.uuid for d in snapshot.devices()]
    derived = 0
    for _ in range(30):
        changed: dict[str, DeviceUsage | None] = {}
        for uuid in rng.sample(uuids, 6):
            milli = rng.choice([0, 250, 500, 1000])
            changed[uuid] = DeviceUsage(milli, milli * 1024) if milli else None
        if rng.random() < 0.2:
            changed["no-such-device"] = DeviceUsage(500, 1)  # unknown to the index: ignored
        snapshot = snapshot.retaken(snapshot.taken_at + 1, changed=changed)
        assert snapshot.usage_from is not None and snapshot.usage_from[1] == frozenset(changed)
        hits_before = placement_index._USAGES.get(index, snapshot.usage_from[0]) is not None
        derived += hits_before
        milli, mem = usage_arrays(index, snapshot)
        whole = snapshot.retaken(snapshot.taken_at, dict(snapshot.usage))  # no lineage: built in full
        assert whole.usage_from is None
        full_milli, full_mem = usage_arrays(index, whole)
        assert np.array_equal(milli, full_milli) and np.array_equal(mem, full_mem)
        assert not milli.flags.writeable
    assert derived == 30  # every step took the derived way


def test_a_snapshot_built_afresh_has_no_lineage() -> None:
    snapshot = synthetic_fleet(5, seed=1)
    assert snapshot.usage_from is None
    same = snapshot.retaken(1.0)  # the very usage mapping: the arrays' cache hits as it is
    assert same.usage is snapshot.usage and same.usage_from is None
    assert snapshot.with_usage(()).usage_from is None

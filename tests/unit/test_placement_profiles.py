"""Profiles and parts: every preset is a profile of registered parts, built into the same record
as before; ``policy_parts`` changes a weight or swaps a part, and every wrong input is one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpusched import settings
from gpusched.errors import ConfigurationError, PlacementError
from gpusched.placement.choose import SELECTORS, Selector, selector
from gpusched.placement.parts import PARTS, SCORE_FIELDS, Chooser, Part, Point, QueueOrder
from gpusched.placement.policy import Policy
from gpusched.placement.profiles import PROFILES, Profile, Use, profile

# The records the presets were before they became profiles (the old table in policy.py, field for
# field): a profile must build exactly these, so every preset decides as before.
_BEFORE = {
    "gpusched": Policy(score_levels=50, lookahead_ties=16, lookahead_widen=2),
    "random": Policy(name="random", chooser=Chooser.RANDOM, reservations=False, queue_order=QueueOrder.FIFO),
    "first-fit": Policy(name="first-fit", chooser=Chooser.FIRST_FIT, reservations=False,
                        round_up_fractions=True, queue_order=QueueOrder.FIFO),
    "best-fit": Policy(name="best-fit", chooser=Chooser.BEST_FIT, reservations=False,
                       queue_order=QueueOrder.FIFO),
    "fgd": Policy(name="fgd", fragmentation=1.0, locality=0.0, speed=0.0, energy=0.0, packing=0.0,
                  score_levels=100, reservations=False, queue_order=QueueOrder.FIFO),
}
_BEFORE["fgd-full"] = dataclasses.replace(_BEFORE["fgd"], name="fgd-full")
_BEFORE["fgd-lookahead"] = dataclasses.replace(_BEFORE["fgd-full"], name="fgd-lookahead", lookahead_ties=16)
_BEFORE["fgd-memory"] = dataclasses.replace(_BEFORE["fgd-lookahead"], name="fgd-memory")


@pytest.mark.parametrize("name", list(_BEFORE))
def test_every_preset_builds_the_record_it_had(name: str) -> None:
    built = Policy.named(name)
    assert built == _BEFORE[name]
    for f in dataclasses.fields(Policy):  # same values and same types (100, not 100.0)
        assert type(getattr(built, f.name)) is type(getattr(_BEFORE[name], f.name)), f.name
    assert Policy.configured(name, "") == built


def test_the_presets_are_the_profiles_in_order() -> None:
    assert Policy.names() == tuple(PROFILES) == tuple(_BEFORE)
    assert Policy.names()[0] == "gpusched"
    assert profile(" FGD ") is PROFILES["fgd"]
    assert profile("nope") is None


def test_named_keeps_its_overrides_and_errors() -> None:
    assert Policy.named("gpusched", locality=0.0).locality == 0.0
    with pytest.raises(PlacementError, match="unknown placement policy 'nope'; use one of: gpusched"):
        Policy.named("nope")
    with pytest.raises(PlacementError, match=r"unknown Policy field\(s\) \['bogus'\]"):
        Policy.named("gpusched", bogus=1)


def test_registry_parts_set_policy_fields_and_cover_the_record() -> None:
    valid = {f.name for f in dataclasses.fields(Policy)}
    set_by_parts: set[str] = set()
    for point, parts in PARTS.items():
        assert parts, point
        for name, part in parts.items():
            assert part.point is point and part.name == name
            keys = set(part.sets) | set(part.off) | {p.field for p in part.params}
            assert keys <= valid, (name, keys - valid)
            set_by_parts |= keys
            assert not (part.always and (part.params or part.sets)), name
    # What no part sets is data handed in by the caller, not a choice of the profile.
    assert valid - set_by_parts - {"name"} == {"throughput", "workload", "host_task_workload"}
    assert set(SCORE_FIELDS) == {p.params[0].field for p in PARTS[Point.SCORE].values()}


def test_score_defaults_are_the_records_defaults() -> None:
    """``score.x=on`` adds a score at the weight the gpusched preset (and Policy()) gives it."""
    for part in PARTS[Point.SCORE].values():
        (weight,) = part.params
        assert weight.name == "weight"
        assert weight.default == getattr(Policy(), weight.field)


def test_every_profile_part_is_registered_and_consistent() -> None:
    for name, prof in PROFILES.items():
        assert prof.name == name and prof.summary
        for use in prof.uses():
            assert PARTS[use.part.point][use.name] is use.part
        assert (prof.tiebreak is not None) == prof.chooser.part.reads_scores
        assert prof.describe().startswith("queue=")


def test_profiles_name_their_parts() -> None:
    gpusched = PROFILES["gpusched"]
    assert gpusched.queue.name == "shortest-first"
    assert [u.name for u in gpusched.filters] == ["partitioned-sharing", "reservations"]
    assert {u.name: u.value("weight") for u in gpusched.scores} == {
        "fragmentation": 1.0, "locality": 0.6, "speed": 1.0, "energy": 0.01, "degraded": 5.0}
    assert gpusched.chooser.text() == "levels(levels=50)"
    assert gpusched.tiebreak is not None and gpusched.tiebreak.text() == "lookahead(ties=16, widen=2)"
    assert PROFILES["fgd"].tiebreak == Use.of(Point.TIEBREAK, "earliest")
    assert PROFILES["fgd-lookahead"].tiebreak == Use.of(Point.TIEBREAK, "lookahead", ties=16)
    assert [u.name for u in PROFILES["first-fit"].filters] == ["partitioned-sharing", "whole-devices"]
    assert PROFILES["best-fit"].scores == () and PROFILES["best-fit"].tiebreak is None


def test_an_inconsistent_profile_cannot_be_built() -> None:
    fifo, exact = Use.of(Point.QUEUE, "fifo"), Use.of(Point.CHOOSER, "exact")
    with pytest.raises(ValueError, match="needs at least one score part"):
        Profile("x", "", fifo, exact, tiebreak=Use.of(Point.TIEBREAK, "earliest"))
    with pytest.raises(ValueError, match="reads no score"):
        Profile("x", "", fifo, Use.of(Point.CHOOSER, "random"), scores=(Use.of(Point.SCORE, "locality"),))
    with pytest.raises(ValueError, match="not a queue part"):
        Profile("x", "", exact, exact)
    with pytest.raises(ValueError, match="has no parameter"):
        Use.of(Point.TIEBREAK, "earliest", ties=3)


@pytest.mark.parametrize(("text", "expect"), [
    ("score.locality=0.5, tiebreak=earliest", {"locality": 0.5, "lookahead_ties": 0, "lookahead_widen": 0}),
    ("score.locality.weight=0.3", {"locality": 0.3}),
    ("score.speed=off", {"speed": 0.0}),
    ("score.speed=0", {"speed": 0.0}),
    ("chooser.levels=100", {"score_levels": 100, "chooser": Chooser.SCORE}),
    ("tiebreak.ties=8", {"lookahead_ties": 8, "lookahead_widen": 2}),
    ("tiebreak=lookahead", {"lookahead_ties": 16, "lookahead_widen": 0}),  # a swap starts from defaults
    ("tiebreak=least-left", {"packing": 1.0, "lookahead_ties": 0, "lookahead_widen": 0}),
    ("chooser=exact, tiebreak=least-left",
     {"score_levels": 0, "packing": 1.0, "lookahead_ties": 0, "lookahead_widen": 0}),
    ("chooser=best-fit",  # weights back to the record's defaults (gpusched's), no tie-break
     {"chooser": Chooser.BEST_FIT, "score_levels": 0, "lookahead_ties": 0, "lookahead_widen": 0}),
    ("queue=fifo, queue.aging=2", {"queue_order": QueueOrder.FIFO, "aging_per_hour": 2.0}),
    ("queue.halving_s=43200", {"service_halving_s": 43200.0, "unknown_service_s": 3600.0}),
    ("queue=ranked", {"queue_order": QueueOrder.RANKED}),
    ("filter.reservations=off", {"reservations": False}),
    ("filter.reservations.critical_priority=50", {"reservations": True, "critical_priority": 50}),
    ("filter.whole-devices=on", {"round_up_fractions": True}),
    ("filter.partitioned-sharing=off", {"fractions_need_partitioning": False}),
    # Order does not matter: swaps, then switches and weights, then parameters.
    ("tiebreak.widen=1, tiebreak=lookahead", {"lookahead_ties": 16, "lookahead_widen": 1}),
    ("TieBreak = Earliest,\n score.energy=on", {"lookahead_ties": 0, "lookahead_widen": 0, "energy": 0.01}),
])
def test_policy_parts_change_the_gpusched_record(text: str, expect: dict[str, object]) -> None:
    before = Policy.named("gpusched")
    after = Policy.configured("gpusched", text, throughput={"a": {"V100": 1.0}})
    assert after.throughput == {"a": {"V100": 1.0}}
    for key, value in expect.items():
        assert getattr(after, key) == value, key
    changed = {f.name for f in dataclasses.fields(Policy)
               if getattr(after, f.name) != getattr(before, f.name)}
    assert changed <= set(expect) | {"throughput"}


def test_parts_give_a_baseline_a_score() -> None:
    p = Policy.configured("best-fit", "chooser=levels, score.fragmentation=1")
    assert (p.chooser, p.score_levels, p.fragmentation, p.locality, p.degraded_penalty) == (
        Chooser.SCORE, 100, 1.0, 0.0, 0.0)
    assert p.lookahead_ties == 0 and p.packing == 0.0  # the tie-break a new score chooser starts with
    # fgd with fgd-lookahead's tie-break is fgd-lookahead under another name.
    assert dataclasses.replace(Policy.configured("fgd", "tiebreak=lookahead"), name="fgd-lookahead") == \
        Policy.named("fgd-lookahead")


@pytest.mark.parametrize(("text", "message"), [
    ("locality", "'locality' is not key=value; e.g. score.locality=0.5, tiebreak=earliest"),
    ("score.locality=", "'score.locality=' is not key=value"),
    ("foo.bar=1",
     "'foo' (in foo.bar) is not an extension point; use queue, filter, score, chooser, tiebreak"),
    ("queue.a.b=1", "queue.a.b is not a part or a parameter"),
    ("score.locality=1, score.locality=2", "score.locality is given twice"),
    ("tiebreak=nearest",
     "tiebreak 'nearest' is not a part; tiebreak accepts: earliest, least-left, lookahead"),
    ("queue=lifo", "queue 'lifo' is not a part; queue accepts: fifo, shortest-first, ranked"),
    ("chooser=best",
     "chooser 'best' is not a part; chooser accepts: exact, levels, best-fit, first-fit, random"),
    ("score.foo=1",
     "score 'foo' is not a part; score accepts: fragmentation, locality, speed, energy, degraded"),
    ("filter.gpu=on", "filter 'gpu' is not a part; filter accepts: devices, free, topology"),
    ("tiebreak.depth=3", "tiebreak lookahead has no parameter 'depth'; it accepts ties (an integer ≥ 1, "
                         "default 16), widen (an integer ≥ 0, default 0)"),
    ("queue=fifo, queue.unknown_s=3", "queue fifo has no parameter 'unknown_s'; it accepts aging"),
    ("score.locality.foo=1",
     "score locality has no parameter 'foo'; it accepts weight (a number ≥ 0, default 0.6)"),
    ("tiebreak.ties=0", "tiebreak.ties = '0' is not valid; ties of tiebreak lookahead takes an integer ≥ 1"),
    ("tiebreak.ties=1.5", "tiebreak.ties = '1.5' is not valid"),
    ("chooser.levels=1", "chooser.levels = '1' is not valid; levels of chooser levels takes an integer ≥ 2"),
    ("queue.halving_s=0",
     "queue.halving_s = '0' is not valid; halving_s of queue shortest-first takes a number > 0"),
    ("score.locality=x",
     "score.locality = 'x' is not valid; the weight of score locality takes a number ≥ 0"),
    ("score.locality=-1", "score.locality = '-1' is not valid"),
    ("score.locality=nan", "score.locality = 'nan' is not valid"),
    ("filter.devices=off", "filter devices is always on (a hard constraint); the optional filters are: "
                           "partitioned-sharing, whole-devices, reservations"),
    ("filter.devices.x=1", "filter devices is always on and has no parameters"),
    ("filter.reservations=maybe", "filter.reservations = 'maybe' is not on or off"),
    ("filter.whole-devices.x=1", "filter whole-devices is off in profile gpusched; switch it on with "
                                 "filter.whole-devices=on"),
    ("filter.reservations.critical=1", "filter reservations has no parameter 'critical'"),
    ("chooser=exact", "tiebreak lookahead needs chooser=levels (it breaks the integer score's ties), the "
                      "chooser is exact; swap it too, e.g. tiebreak=earliest"),
    ("chooser=best-fit, score.locality=1", "score.locality does nothing: chooser best-fit reads no score or "
                                           "tie-break parts; use it with chooser=exact or chooser=levels"),
    ("chooser=random, tiebreak.ties=3", "tiebreak.ties does nothing: chooser random reads no score"),
    ("chooser=first-fit, tiebreak=earliest", "tiebreak=earliest does nothing: chooser first-fit"),
    ("score.fragmentation=off, score.locality=off, score.speed=off, score.energy=off, score.degraded=off",
     "chooser levels needs at least one score part, e.g. score.fragmentation=1"),
])
def test_each_bad_input_is_one_line_naming_what_is_accepted(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        Policy.configured("gpusched", text)
    assert str(err.value).startswith("[gpusched] policy_parts: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_baseline_needs_a_score_when_it_gets_a_score_chooser() -> None:
    with pytest.raises(ConfigurationError, match="chooser levels needs at least one score part"):
        Policy.configured("best-fit", "chooser=levels")


def test_an_unknown_preset_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"^\[gpusched\] policy = 'nope' is not a placement policy; "
                                                 r"use one of: gpusched, random, first-fit"):
        Policy.configured("nope", "")


def test_with_parts_names_where_the_text_came_from() -> None:
    with pytest.raises(ConfigurationError, match=r"^--parts: "):
        PROFILES["fgd"].with_parts("tiebreak=x", where="--parts")
    assert PROFILES["fgd"].with_parts("") is not None


def test_part_accepts_lists_parameters() -> None:
    part: Part = PARTS[Point.TIEBREAK]["earliest"]
    assert part.accepts() == "no parameters"
    accepts = PARTS[Point.QUEUE]["shortest-first"].accepts()
    assert accepts.startswith("halving_s (a number > 0, default 86400)")


class _Conf:
    """Airflow's conf.get(section, key, fallback=...) over a dict (the executor's team conf)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, section: str, key: str, fallback: str = "") -> str:
        assert section == settings.SECTION
        return self.values.get(key, fallback)


def test_the_gpusched_settings_build_the_configured_policy() -> None:
    """What the executor's ``policy`` property reads: ``[gpusched] policy`` and ``policy_parts``."""
    def read(conf: _Conf) -> Policy:
        return Policy.configured(settings.get_str("policy", conf), settings.get_str("policy_parts", conf))

    assert settings.default("policy_parts") == ""
    assert read(_Conf({})) == Policy.named("gpusched")
    changed = read(_Conf({"policy": "gpusched", "policy_parts": "score.locality=0.5, tiebreak=earliest"}))
    assert (changed.locality, changed.lookahead_ties, changed.score_levels) == (0.5, 0, 50)
    assert read(_Conf({"policy": "best-fit"})) == Policy.named("best-fit")
    example = settings.OPTIONS[[o.name for o in settings.OPTIONS].index("policy_parts")].example
    assert example is not None and read(_Conf({"policy_parts": example})).locality == 0.5
    with pytest.raises(ConfigurationError, match=r"^\[gpusched\] policy_parts: score 'local' is not a part"):
        read(_Conf({"policy_parts": "score.local=1"}))


def test_the_engine_dispatches_on_every_chooser_part() -> None:
    assert set(SELECTORS) == set(Chooser)
    for part in PARTS[Point.CHOOSER].values():
        picker = SELECTORS[part.sets["chooser"]]  # type: ignore[index]
        assert isinstance(picker, Selector)
        assert picker.scored == part.reads_scores
    assert selector(Policy.named("first-fit")).gang_order == "first"
    assert selector(Policy.named("random")).gang_order == "random"
    assert selector(Policy.named("gpusched")).scored and not selector(Policy.named("best-fit")).scored


def test_the_placement_docs_list_every_part_and_profile() -> None:
    """docs/placement.md, "Profiles and parts": one row per registered part, each preset's parts."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "placement.md").read_text()
    section = docs[docs.index("## Profiles and parts"):docs.index("## Reservations and backfill")]
    for point, parts in PARTS.items():
        for name in parts:
            assert f"| {point} | `{name}` |" in section, (point, name)
    for prof in PROFILES.values():
        assert f"| `{prof.name}` | `{prof.describe()}` |" in section, prof.name

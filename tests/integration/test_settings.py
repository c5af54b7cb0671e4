"""The settings module: one source for the [gpusched] options, the provider info and the docs."""

from __future__ import annotations

import re
from pathlib import Path

import airflow
import jsonschema
import pytest

from gpusched import __version__
from gpusched.errors import ConfigurationError
from gpusched.provider_info import get_provider_info
from gpusched.settings import ENV_VARS, OPTIONS, env_bool, get_bool, get_float, get_int, get_str, parse_bool

REPO = Path(__file__).resolve().parents[2]


class _Conf:
    """Stands in for an executor's team-scoped ``self.conf`` (the same ``get`` signature)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.asked: list[tuple[str, str]] = []

    def get(self, section: str, key: str, fallback: str | None = None) -> str | None:
        self.asked.append((section, key))
        return self.values.get(key, fallback)


def test_provider_info_is_valid_for_airflow_and_generated_from_the_settings() -> None:
    import json

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    assert info["package-name"] == "gpusched" and info["versions"] == [__version__]
    assert info["executors"] == [
        "gpusched.airflow.executor.GPUExecutor", "gpusched.airflow.celery_executor.GPUCeleryExecutor",
    ]
    options = info["config"]["gpusched"]["options"]
    assert list(options) == [o.name for o in OPTIONS]
    for option in OPTIONS:
        assert options[option.name]["default"] == option.default
        assert options[option.name]["type"] == option.type
        assert options[option.name]["description"] == option.description


def test_readers_use_the_given_team_conf_and_the_declared_defaults() -> None:
    conf = _Conf({"lease_seconds": "42", "replan_budget_ms": "2.5", "fail_unschedulable": "no"})
    assert get_int("lease_seconds", conf) == 42
    assert get_float("replan_budget_ms", conf) == 2.5
    assert get_bool("fail_unschedulable", conf) is False
    assert get_bool("sync_inventory_on_start", conf) is True  # declared default "True"
    assert get_str("policy", conf) == "gpusched"
    assert ("gpusched", "lease_seconds") in conf.asked
    assert get_bool("pool_sync", conf, empty=True) is True  # empty default follows the caller


def test_bad_values_and_unknown_options_say_what_to_do() -> None:
    with pytest.raises(ConfigurationError, match=r"\[gpusched\] lease_seconds = 'ten' is not an integer"):
        get_int("lease_seconds", _Conf({"lease_seconds": "ten"}))
    with pytest.raises(ConfigurationError, match="not a boolean; use true or false"):
        get_bool("fail_unschedulable", _Conf({"fail_unschedulable": "maybe"}))
    with pytest.raises(ConfigurationError, match="not a gpusched option; options: policy"):
        get_str("polcy", _Conf({}))


@pytest.mark.parametrize(("raw", "expected"), [
    ("1", True), ("TRUE", True), (" yes ", True), ("on", True),
    ("0", False), ("False", False), ("no", False), ("off", False), ("", False),
])
def test_parse_bool(raw: str, expected: bool) -> None:
    assert parse_bool(raw) is expected


def test_env_bool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSCHED_POOL_SYNC", raising=False)
    assert env_bool("GPUSCHED_POOL_SYNC") is False and env_bool("GPUSCHED_POOL_SYNC", True) is True
    monkeypatch.setenv("GPUSCHED_POOL_SYNC", "on")
    assert env_bool("GPUSCHED_POOL_SYNC") is True
    monkeypatch.setenv("GPUSCHED_POOL_SYNC", "sometimes")
    with pytest.raises(ConfigurationError, match="GPUSCHED_POOL_SYNC = 'sometimes'"):
        env_bool("GPUSCHED_POOL_SYNC")


def test_every_variable_the_code_reads_is_declared_and_documented() -> None:
    used: set[str] = set()
    for folder in ("gpusched", "dags", "scripts"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in {".py", ".sh"}:
                used |= set(re.findall(r"\bGPUSCHED_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    used |= set(re.findall(r"\bGPUSCHED_[A-Z0-9_]*[A-Z0-9]\b", (REPO / "docker-compose.yaml").read_text()))
    declared = {var.name for var in ENV_VARS}
    assert used - declared == set(), "declare these in gpusched/settings.py ENV_VARS"
    docs = (REPO / "docs" / "settings.md").read_text()
    for name in declared:
        assert f"`{name}`" in docs, f"{name} missing from docs/settings.md"
    for option in OPTIONS:
        assert f"`{option.name}`" in docs, f"{option.name} missing from docs/settings.md"

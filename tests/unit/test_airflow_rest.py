"""The REST client's base URL comes from the running instance's configuration, never a guess."""

from __future__ import annotations

import pytest

from gpusched.airflow.rest import AirflowApi, base_url_from_config
from gpusched.errors import ConfigurationError


class _Conf:
    def __init__(self, **values: str) -> None:
        self.values = values

    def get(self, section: str, key: str, fallback: str | None = None) -> str | None:
        return self.values.get(f"{section}.{key}", fallback)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"api.base_url": "https://airflow.example.org/", "api.port": "8080"}, "https://airflow.example.org"),
        ({"core.execution_api_server_url": "http://127.0.0.1:18793/execution/", "api.port": "8080"},
         "http://127.0.0.1:18793"),
        ({"api.host": "0.0.0.0", "api.port": "18794"}, "http://127.0.0.1:18794"),
        ({"api.host": "10.1.2.3", "api.port": "9000", "api.base_url": "/airflow"}, "http://10.1.2.3:9000/airflow"),
        ({"api.host": "::", "api.port": "9000"}, "http://127.0.0.1:9000"),
    ],
)
def test_base_url_from_config(values: dict[str, str], expected: str) -> None:
    assert base_url_from_config(_Conf(**values)) == expected


def test_no_address_in_config_is_an_error_not_a_guess() -> None:
    with pytest.raises(ConfigurationError, match="GPUSCHED_AIRFLOW_API_URL"):
        base_url_from_config(_Conf())


def test_main_job_on_another_port_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # scripts/run.sh with GPUSCHED_PORT: the instance's own settings name the port.
    monkeypatch.delenv("GPUSCHED_AIRFLOW_API_URL", raising=False)
    monkeypatch.setenv("AIRFLOW__API__PORT", "18795")
    monkeypatch.setenv("AIRFLOW__API__HOST", "127.0.0.1")
    monkeypatch.delenv("AIRFLOW__API__BASE_URL", raising=False)
    monkeypatch.delenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", raising=False)
    assert AirflowApi(credentials=("admin", "secret")).base_url == "http://127.0.0.1:18795"
    monkeypatch.setenv("GPUSCHED_AIRFLOW_API_URL", "http://127.0.0.1:18796")
    assert AirflowApi(credentials=("admin", "secret")).base_url == "http://127.0.0.1:18796"

"""Project metadata that every install reads: no deprecated forms setuptools warns about."""

from __future__ import annotations

import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_license_is_an_spdx_expression_not_the_deprecated_table() -> None:
    data = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    assert data["project"]["license"] == "Apache-2.0"
    assert not any("License ::" in c for c in data["project"].get("classifiers", ()))
    # SPDX strings need setuptools 77 or newer (PEP 639).
    assert any(r.replace(" ", "").startswith("setuptools>=7") and int(r.split(">=")[1].split(".")[0]) >= 77
               for r in data["build-system"]["requires"])

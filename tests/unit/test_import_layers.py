"""The layers contract of the gpusched package, checked by import-linter (``lint-imports``).

The contracts live in pyproject.toml (``[tool.importlinter]``): the layers (faces → scheduler →
policy → store and devices → vocabulary), pure policy apart from the store, the lab apart from the
Airflow faces, only the faces importing ``airflow``, and no import cycles between siblings at any
depth. Imports inside functions and under ``TYPE_CHECKING`` count (a lazy import hides a
crossing, it does not remove it). Module length is not a rule.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from importlinter.api import read_configuration
from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpusched"
CONFIG = str(ROOT / "pyproject.toml")
AIRFLOW_FACES = {"airflow", "deploy"}


def _contract(contract_id: str) -> dict[str, list[str]]:
    contracts = read_configuration(CONFIG)["contracts_options"]
    return next(c for c in contracts if c["id"] == contract_id)


def _top_level() -> set[str]:
    """Every module and package directly under gpusched/ (``include`` is data)."""
    names = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    return names


def test_every_contract_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # lint-imports reads the package from the working directory first
    # lint-imports configures logging with dictConfig, which disables every logger that exists
    # already: put them back, or a later test in this process hears nothing from them.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = {lg: lg.disabled for lg in loggers}
    try:
        status = lint_imports(config_filename=CONFIG, no_cache=True, no_logo=True)
    finally:
        for lg, was in disabled.items():
            lg.disabled = was
    assert status == EXIT_STATUS_SUCCESS, "lint-imports found a broken contract (report above)"


def test_every_top_level_module_is_in_a_layer() -> None:
    named = set()
    for layer in _contract("layers")["layers"]:
        named |= {part.strip() for part in layer.replace("|", ":").split(":")}
    assert _top_level() - named == set(), "add the new module to a layer in pyproject.toml"


def test_every_module_outside_the_faces_is_kept_from_airflow() -> None:
    sources = {s.removeprefix("gpusched.") for s in _contract("airflow-faces-only")["source_modules"]}
    assert _top_level() - AIRFLOW_FACES - sources == set(), "add it to airflow-faces-only's source_modules"

"""The layers contract of the gpusched package, checked by import-linter (``lint-imports``).

The contracts live in pyproject.toml (``[tool.importlinter]``): the layers (faces → scheduler →
policy → store and devices → vocabulary), pure policy apart from the store, the lab apart from the
Airflow faces, only the faces importing ``airflow``, and no import cycles between siblings at any
depth. Imports inside functions and under ``TYPE_CHECKING`` count (a lazy import hides a
crossing, it does not remove it). Module length is not a rule.

A function-local import of the package's own modules is for a heavy third-party import or a real
cycle only: at most :data:`MAX_LOCAL_IMPORTS` of them, each group with its one-line reason.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from importlinter.api import read_configuration
from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpusched"
CONFIG = str(ROOT / "pyproject.toml")
AIRFLOW_FACES = {"airflow", "deploy"}
MAX_LOCAL_IMPORTS = 40


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


def _imports_gpusched(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").startswith("gpusched")
    return isinstance(node, ast.Import) and any(a.name.startswith("gpusched") for a in node.names)


def _own_local_imports() -> list[tuple[str, int, bool]]:
    """(module, line, has a reason) of each import of gpusched inside a function: a reason is a
    comment on the line or the one above, or the reasoned import right above (one group)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        reasoned: set[int] = set()
        seen: set[int] = set()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for inner in ast.walk(node):
                if not _imports_gpusched(inner) or inner.lineno in seen:  # nested functions: once
                    continue
                line = inner.lineno
                seen.add(line)
                above = lines[line - 2].strip() if line > 1 else ""
                ok = "#" in lines[line - 1] or above.startswith("#") or line - 1 in reasoned
                if ok:
                    reasoned.add(inner.end_lineno or line)
                found.append((str(path.relative_to(ROOT)), line, ok))
    return found


def test_function_local_imports_of_own_modules_are_few_and_give_their_reason() -> None:
    found = _own_local_imports()
    unexplained = [f"{module}:{line}" for module, line, ok in found if not ok]
    assert unexplained == [], "say why on the line above (a heavy import, a cycle) or import at the top"
    assert len(found) <= MAX_LOCAL_IMPORTS, f"{len(found)} function-local imports of gpusched; import at top"

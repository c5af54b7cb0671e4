"""Layering rules of the gpusched package, read from the source (``ast``, nothing imported).

* No import cycles among gpusched modules — counting every import, also those inside functions
  and under ``TYPE_CHECKING`` (a lazy import hides a cycle, it does not remove it).
* Only ``gpusched/airflow/`` and ``gpusched/deploy/`` import ``airflow``.
* No module under ``gpusched/`` is longer than 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpusched"
MAX_LINES = 400
AIRFLOW_ALLOWED = ("gpusched.airflow", "gpusched.deploy")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(gpusched modules ``name`` imports, top-level third-party packages it imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.append(base)
            targets.extend(f"{base}.{alias.name}" for alias in node.names)
    internal, external = set(), set()
    for target in targets:
        if target == "gpusched" or target.startswith("gpusched."):
            if target in known and target != name:
                internal.add(target)
        elif target:
            external.add(target.split(".")[0])
    return internal, external


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    known = set(modules)
    edges, external = {}, {}
    for name, path in modules.items():
        edges[name], external[name] = _imports(name, path, known)
    return edges, external


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _is_package_parent(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_gpusched_modules() -> None:
    edges, _ = _graph()
    # A package's __init__ re-exporting its submodules is not a cycle of concepts: drop the edge
    # from a submodule to its own enclosing package (``from gpusched.placement import x``
    # inside gpusched.placement.y resolves to the submodule x, which the edge set already has).
    pruned = {m: {t for t in ts if not _is_package_parent(t, m)} for m, ts in edges.items()}
    cycles = _cycles(pruned)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_only_the_airflow_and_deploy_packages_import_airflow() -> None:
    _, external = _graph()
    offenders = sorted(
        name
        for name, packages in external.items()
        if "airflow" in packages
        and not any(name == p or name.startswith(p + ".") for p in AIRFLOW_ALLOWED)
    )
    assert not offenders, f"modules importing airflow outside gpusched/airflow and deploy: {offenders}"


def test_no_module_exceeds_400_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"

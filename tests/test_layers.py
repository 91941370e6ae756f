"""The package's layers: imports flow one way, from the CLI down to the core, and close no circle.

Every import counts, also one inside a function or under `if TYPE_CHECKING:` (each is a dependency a
reader has to follow, and either can close a circle). The order and each package's job are in
docs/architecture.md.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "fila"

# Bottom to top: a module may import its own package and any package below it.
LAYERS = [
    ("core", "assets"),
    ("egress",),
    ("queue",),
    ("workspace",),
    ("engines",),
    ("sandbox",),
    ("env",),
    ("provenance",),
    ("review",),
    ("recovery",),
    ("run",),
    ("ops",),
    ("web",),
    ("api",),
    ("mcp",),
    # `fila` itself: its lazy `Client` attribute (api/client.py).
    ("cli", "entry", "_help", "__main__", "fila"),
]

# The upward imports the seams still have to remove, each with the seam that removes it. The test
# fails on any other upward import, and on an entry here that no longer exists (so the list only
# shrinks).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and docs/architecture.md")


def imports(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the fila modules it imports, wherever the import statement stands."""
    files = {}
    for p in src.rglob("*.py"):
        parts = p.relative_to(src.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, p in files.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                for a in node.names:
                    hit = f"{target}.{a.name}" if f"{target}.{a.name}" in files else target
                    if hit in files and hit != m:
                        graph[m].add(hit)
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name in files and a.name != m}
    return graph


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, t) for m, targets in graph.items() for t in targets if _layer(t) > _layer(m)}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_layer_and_imports_flow_down() -> None:
    graph = imports()
    assert graph["fila.run.worker"] and graph["fila.cli"], "the graph reads the imports"
    # A planted upward import (the core reaching for the job runner) is found: the check can fail.
    planted = {**graph, "fila.core.errors": graph["fila.core.errors"] | {"fila.run.job"}}
    assert ("fila.core.errors", "fila.run.job") in upward(planted)
    assert upward(graph) - KNOWN_UPWARD == set()
    assert KNOWN_UPWARD - upward(graph) == set(), "a seam removed these: take them off KNOWN_UPWARD"


def test_the_modules_close_no_import_circle_beyond_the_known_upward_imports() -> None:
    graph = imports()
    assert circles({**graph, "fila.x": {"fila.y"}, "fila.y": {"fila.x"}}) != [], "the detector finds one"
    without_known = {m: {t for t in ts if (m, t) not in KNOWN_UPWARD} for m, ts in graph.items()}
    assert circles(without_known) == []


# Private names (a leading underscore) another module still imports, each with the seam that
# removes it; any other crossing fails.
KNOWN_PRIVATE: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(src: Path = SRC) -> set[tuple[str, str]]:
    """(module, name) for every private name a module imports from another fila module, by
    `from ... import _name` or as `module._name`."""
    out = set()
    for p in src.rglob("*.py"):
        parts = p.relative_to(src.parent).with_suffix("").parts
        m = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(p.read_text())
        modules = {  # names bound to fila modules in this file
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("fila"))
            for a in n.names
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("fila")):
                out |= {
                    (m, a.name) for a in n.names if a.name.startswith("_") and not a.name.startswith("__")
                }
            elif (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id in modules
                and _private(n.attr)
            ):
                out.add((m, n.attr))
    return out


def test_no_private_name_crosses_a_module_beyond_the_known_ones(tmp_path: Path) -> None:
    planted = tmp_path / "fila"
    (planted / "sub").mkdir(parents=True)
    (planted / "sub" / "a.py").write_text("from . import b\nfrom .b import _hidden\nb._other()\n")
    (planted / "sub" / "b.py").write_text("def _hidden(): ...\ndef _other(): ...\n")
    assert private_imports(planted) == {("fila.sub.a", "_hidden"), ("fila.sub.a", "_other")}
    found = private_imports()
    assert found - KNOWN_PRIVATE == set()
    assert KNOWN_PRIVATE - found == set(), "a seam removed these: take them off KNOWN_PRIVATE"


def test_only_the_container_backends_import_the_docker_sdk() -> None:
    importers = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if re.search(r"^\s*(import docker\b|from docker[. ])", p.read_text(), re.MULTILINE)
    )
    assert importers, "the check finds the backends' imports"
    assert all(p.startswith(("sandbox/docker/", "sandbox/podman/")) for p in importers), importers


def test_the_backends_reach_the_job_directory_only_through_the_workspace_seam() -> None:
    """A backend mounts and hands back a job's files through its RunSpec's Workspace
    (core/mounts.py); how a job directory is made (jobdir, handover, snapshot, overlay) is the
    workspace package's."""
    graph = imports()
    backends = [m for m in graph if m.startswith("fila.sandbox.")]
    assert "fila.sandbox.docker.container" in backends
    reach = {
        (m, t)
        for m in backends
        for t in graph[m]
        if t
        in (
            "fila.workspace.jobdir",
            "fila.workspace.snapshot",
            "fila.workspace.snapshot_gc",
            "fila.workspace.overlay",
            "fila.workspace.handover",
        )
    }
    assert reach == set()


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every fila module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for t in graph.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_the_file_queue_never_imports_the_postgresql_queue() -> None:
    """fila.queue.pg is imported only with a queue URL (its __init__): the file queue's worker,
    store, breaker, review and compare group rules reach none of it, by any import."""
    graph = imports()
    file_queue = ["fila.run.worker", "fila.queue.store", "fila.queue.breaker", "fila.review.apply",
                  "fila.review.groups", "fila.review.decision"]  # fmt: skip
    assert all(graph[m] for m in file_queue), "the graph reads their imports"
    # A planted import of the PostgreSQL queue's records (where check_group once was) is found.
    planted = {**graph, "fila.review.groups": graph["fila.review.groups"] | {"fila.queue.pg.records"}}
    assert "fila.queue.pg.records" in _reach(planted, "fila.review.groups")
    assert {m: sorted(t for t in _reach(graph, m) if t.startswith("fila.queue.pg")) for m in file_queue} == {
        m: [] for m in file_queue
    }

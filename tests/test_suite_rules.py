"""Rules of the suite itself: what a test module may import of tests/.

A test module imports the shared helpers from tests.support (fixtures come from tests/conftest.py)
and the scripted upstreams from tests.upstreams, never another test module: a helper that lives in
a test module makes its importer run that module's imports and tie its meaning to a file about
something else, and a fixture imported that way is collected twice.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

from tests.support.spy import watch

TESTS = Path(__file__).resolve().parent
SHARED = {"support", "upstreams"}  # the packages of tests/ a test module may import


def _resolve(module: str | None, level: int, here: str) -> str:
    """The absolute name of `from <level dots><module> import ...` in the module `here`."""
    if not level:
        return module or ""
    base = here.split(".")[:-level]
    return ".".join([*base, module] if module else base)


def imports_of_tests(tests: Path = TESTS) -> set[tuple[str, str]]:
    """(module, the module of tests/ it imports) for every import of tests/ outside the shared
    packages, wherever the import statement stands (also inside a function)."""
    found = set()
    for p in sorted(tests.rglob("*.py")):
        parts = p.relative_to(tests.parent).with_suffix("").parts
        here = ".".join(parts)
        for node in ast.walk(ast.parse(p.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(node.module, node.level, here)
                names = [mod] + [f"{mod}.{a.name}" for a in node.names if mod == parts[0]]
            for name in names:
                if name.split(".")[0] != parts[0] or name == parts[0]:
                    continue  # not of tests/ (or the bare package, as `from tests import support`)
                if name.split(".")[1] in SHARED:
                    continue
                found.add((here, name))
    return found


def test_no_test_module_imports_another_and_the_shared_code_lives_in_support(tmp_path: Path) -> None:
    # A planted suite: each way of reaching another test module is found, the shared packages are not.
    planted = tmp_path / "tests"
    (planted / "support").mkdir(parents=True)
    (planted / "__init__.py").write_text("")
    (planted / "support" / "__init__.py").write_text("")
    (planted / "support" / "cli.py").write_text("def fila(): ...\n")
    (planted / "test_a.py").write_text(
        "from tests.support.cli import fila\n"
        "from tests.upstreams.fixtures import LABEL\n"
        "from .test_b import helper\n"
        "def test_x():\n"
        "    import tests.test_c\n"
        "    from tests import test_d\n"
    )
    (planted / "test_b.py").write_text(
        "from . import support\nfrom .support.cli import fila\ndef helper(): ...\n"
    )
    assert imports_of_tests(planted) == {
        ("tests.test_a", "tests.test_b"),
        ("tests.test_a", "tests.test_c"),
        ("tests.test_a", "tests.test_d"),
    }
    assert imports_of_tests() == set(), "import it from tests.support (fixtures: tests/conftest.py)"


def test_the_spy_sees_each_read_of_a_file_and_each_process_started(tmp_path: Path) -> None:
    """The tests that prove "without reading it" with tests.support.spy.watch are not vacuous."""
    (tmp_path / "read").write_text("x")
    (tmp_path / "unread").write_text("x")
    with watch() as seen:
        fd = os.open(tmp_path / "read", os.O_RDONLY)
        os.close(fd)
        assert not seen.read(tmp_path / "read"), "an open is not a read"
        fd = os.open(tmp_path / "read", os.O_RDONLY)
        assert os.read(fd, 1) == b"x"
        os.close(fd)
        subprocess.run(["true"], check=True)
    assert seen.read(tmp_path / "read") and not seen.read(tmp_path / "unread")
    assert seen.processes == [["true"]]

"""Git metadata in a patch, on a real Docker engine: a directory the engine makes look like a git
repository (HEAD, objects/, refs/, any name) is flagged by review and refused by apply unless
the person passes --allow-git-metadata; ordinary directories of those names are not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fila.core.layout import Root
from tests.support.cli import fila, run_shell
from tests.support.project import record

pytestmark = pytest.mark.docker

FLAG = "--allow-git-metadata"
# A bare repository by hand (the shell image has no git): what git's discovery accepts.
BARE = (
    "mkdir -p vendor/lib/objects/ab vendor/lib/refs/heads && "
    "echo 'ref: refs/heads/main' > vendor/lib/HEAD && "
    "printf '[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > vendor/lib/config && "
    "echo blob > vendor/lib/objects/ab/cdef && echo 0000 > vendor/lib/refs/heads/main && "
    "sed -i s/hello/world/ greeting.txt"
)


@pytest.fixture
def proj(proj: Root) -> Path:
    """The shared queue root (conftest), as the path this module's tests build on."""
    return proj.path


def project_files(proj: Path) -> dict[str, bytes]:
    """The project's files and contents, without fila's own directories."""
    own = {"fila", "sandbox", "policies"}
    return {
        str(p.relative_to(proj)): p.read_bytes()
        for p in proj.rglob("*")
        if p.is_file() and p.relative_to(proj).parts[0] not in own
    }


def warnings_of(proj: Path, tid: str) -> tuple[list[str], str, str]:
    """The warnings as --json, the terminal view and REVIEW.html show them."""
    as_json = fila(proj, "review", tid, "--json")
    assert as_json.exit_code == 0, as_json.output
    text = fila(proj, "review", tid)
    assert text.exit_code == 0, text.output
    html = fila(proj, "review", tid, "--html")
    assert html.exit_code == 0, html.output
    return json.loads(as_json.stdout)["warnings"], text.stdout, Path(html.stdout.strip()).read_text()


def test_a_bare_repository_in_the_patch_is_refused_unless_allowed(proj: Path) -> None:
    tid = run_shell(proj, BARE)
    assert "vendor/lib/HEAD" in fila(proj, "diff", tid).stdout
    warnings, text, page = warnings_of(proj, tid)
    flagged = [w for w in warnings if "looks like a git repository" in w]
    assert len(flagged) == 1 and "vendor/lib/" in flagged[0] and FLAG in flagged[0]
    assert "looks like a git repository" in text and FLAG in text
    assert "looks like a git repository" in page and FLAG in page

    before = project_files(proj)
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4, res.output
    assert "look like git repositories" in res.stderr and "vendor/lib/" in res.stderr and FLAG in res.stderr
    assert not (proj / "vendor").exists() and (proj / "greeting.txt").read_text() == "hello\n"
    assert project_files(proj) == before
    assert record(proj, tid)["status"] == "needs_review"  # still undecided

    # The allowed counterpart: with the flag the same patch lands.
    res = fila(proj, "apply", tid, "--yes", FLAG)
    assert res.exit_code == 0, res.output
    assert (proj / "vendor" / "lib" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert (proj / "greeting.txt").read_text() == "world\n"
    assert record(proj, tid)["status"] == "applied"


def test_a_patch_completing_a_repository_the_project_half_has_is_refused(proj: Path) -> None:
    for rel in ("store/objects/ab/x", "store/refs/heads/main"):
        (proj / rel).parent.mkdir(parents=True)
        (proj / rel).write_text("old\n")
    tid = run_shell(proj, "echo 'ref: refs/heads/main' > store/HEAD", "store")
    warnings, _, _ = warnings_of(proj, tid)
    assert any("looks like a git repository" in w and "store/" in w for w in warnings)
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4 and "store/" in res.stderr, res.output
    assert not (proj / "store" / "HEAD").exists()


def test_directories_named_objects_refs_or_head_alone_are_not_flagged(proj: Path) -> None:
    cmd = (
        "mkdir -p objects/ab refs docs && echo a > objects/ab/x && echo b > refs/y && "
        "echo c > docs/HEAD && sed -i s/hello/world/ greeting.txt"
    )
    tid = run_shell(proj, cmd)
    warnings, text, _ = warnings_of(proj, tid)
    assert not [w for w in warnings if "git repository" in w] and "git repository" not in text
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 0, res.output
    assert (proj / "objects" / "ab" / "x").read_text() == "a\n" and (proj / "docs" / "HEAD").is_file()


# Other layouts git's is_git_directory accepts: objects/refs as symlinks or executable
# files (access(X_OK) passes), a commondir that points them elsewhere, a HEAD beside a config.
HEAD = "mkdir -p x && echo 'ref: refs/heads/main' > x/HEAD && sed -i s/hello/world/ greeting.txt && "
LAYOUTS = {
    "symlinks": HEAD
    + "mkdir -p store && echo k > store/k && ln -s ../store x/objects && ln -s ../store x/refs",
    "executable-files": HEAD
    + "printf '#!/bin/sh\\n' > x/objects && cp x/objects x/refs && chmod 755 x/objects x/refs",
    "commondir": HEAD + "echo ../store > x/commondir",
    "config": HEAD + "printf '[core]\\n\\tbare = true\\n' > x/config",
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_git_opens_as_a_repository_is_refused_unless_allowed(proj: Path, layout: str) -> None:
    tid = run_shell(proj, LAYOUTS[layout])
    warnings, text, _ = warnings_of(proj, tid)
    assert any("looks like a git repository" in w and "x/" in w for w in warnings), warnings
    assert FLAG in text
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4 and "x/" in res.stderr and FLAG in res.stderr, res.output
    assert not (proj / "x").exists() and (proj / "greeting.txt").read_text() == "hello\n"
    # The allowed counterpart: with the flag the same patch lands.
    res = fila(proj, "apply", tid, "--yes", FLAG)
    assert res.exit_code == 0, res.output
    assert (proj / "x" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert (proj / "greeting.txt").read_text() == "world\n"

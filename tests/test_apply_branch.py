"""`fila apply ID --branch NAME` and the page's "apply as a commit on a new branch"
(review/branch.py): the reviewed patch, through apply's checks, committed on a new branch of the
project's git checkout with trailers, the checked-out branch and working tree untouched. Each
refusal beside its allowed counterpart. Tasks by the fake backend; git is the real one."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from fila.core.errors import ApplyRefused
from fila.core.layout import Root
from fila.provenance import store
from fila.review.branch import OnBranch
from tests.support.cli import fila
from tests.support.project import make_project, record
from tests.support.web import apply_form, client, make_task

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")


def git(root: Root, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root.path), *args], check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture
def root(tmp_path: Path) -> Root:
    r = make_project(tmp_path / "proj", {"src/app.py": "x = 1\n", ".gitignore": "fila/\nsandbox/\n*.log\n"})
    git(r, "init", "-q", "-b", "main")
    git(r, "-c", "user.email=t@example.com", "-c", "user.name=t", "add", "-A")
    git(r, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "base")
    return r


def test_a_patch_lands_as_a_commit_on_a_new_branch_and_nowhere_else(root: Root) -> None:
    tid = make_task(root, "echo world > greeting.txt; echo 'x = 2' > src/app.py; echo kept > src/notes.log",
                    "greeting.txt", "src",
                    prompt="two changes")  # fmt: skip
    head = git(root, "rev-parse", "HEAD").strip()
    res = fila(root, "apply", tid, "--yes", "--by", "alice", "--branch", "fila/two")
    assert res.exit_code == 0, res.output
    assert "on the new branch fila/two" in res.output and "checkout is untouched" in res.output
    assert (root.path / "greeting.txt").read_text() == "hello\n"  # the working tree untouched
    assert (
        git(root, "rev-parse", "HEAD").strip() == head and git(root, "branch", "--show-current") == "main\n"
    )
    assert (
        git(root, "show", "fila/two:greeting.txt") == "world\n"
        and git(root, "show", "fila/two:src/app.py") == "x = 2\n"
    )
    assert git(root, "show", "fila/two:src/notes.log") == "kept\n"  # what the patch adds, ignored or not
    assert git(root, "rev-parse", "fila/two^").strip() == head
    msg = git(root, "log", "-1", "--format=%B", "fila/two")
    rec = record(root, tid)
    assert f"Fila-Task: {tid}" in msg and f"Fila-Patch-Sha256: {rec['patch_sha256']}" in msg
    assert "Reviewed-by: alice" in msg and "two changes" in msg
    assert rec["status"] == "applied" and rec["decision"]["by"] == "alice"
    assert "on the new branch fila/two" in rec["decision"]["reason"]
    assert git(root, "worktree", "list").count("\n") == 1  # the temporary worktree is gone


def test_with_keys_the_commit_names_the_signed_run_statement_and_without_none(
    root: Root, tmp_path: Path
) -> None:
    unsigned = make_task(root, "echo plain > greeting.txt")  # no key yet: provenance is off
    assert fila(root, "apply", unsigned, "--yes", "--branch", "fila/plain").exit_code == 0
    msg = git(root, "log", "-1", "--format=%B", "fila/plain")
    assert f"Fila-Task: {unsigned}" in msg and "Fila-Provenance" not in msg

    assert fila(root, "keys", "init").exit_code == 0
    tid = make_task(root, "echo signed > greeting.txt")
    run = store.path(root, tid, "run").read_bytes()
    beside = tmp_path / "attestations"
    res = fila(
        root, "apply", tid, "--yes", "--by", "alice", "--branch", "fila/signed", "--attestations", str(beside)
    )
    assert res.exit_code == 0, res.output
    trailers = git(root, "log", "-1", "--format=%(trailers:key=Fila-Provenance,valueonly)", "fila/signed")
    assert trailers.strip() == "sha256:" + hashlib.sha256(run).hexdigest()
    assert (beside / f"{tid}.run.intoto.json").read_bytes() == run  # the file the trailer names
    assert (beside / f"{tid}.decision.intoto.json").is_file()
    assert store.path(root, tid, "run").read_bytes() == run  # the statement the history names, kept
    assert fila(root, "verify", tid).exit_code == 0


def test_the_commit_holds_the_reviewed_bytes_whatever_gitattributes_or_filters_say(root: Root) -> None:
    # The patch brings its own .gitattributes (eol and re-encoding) and the reviewer's config has
    # a clean filter: none of them may change a byte between the review and the commit.
    git(root, "config", "filter.upper.clean", "tr a-z A-Z")
    writes = [
        "printf '*.cfg text eol=lf\\nenc.cfg working-tree-encoding=UTF-16LE\\n*.up filter=upper\\n'"
        " > src/.gitattributes",
        "printf 'allow = no\\r\\n' > src/app.cfg",
        "printf 'lower\\n' > src/low.up",
        "printf 'm\\000o\\000d\\000e\\000\\n\\000' > src/enc.cfg",
        "echo plain > greeting.txt",
    ]
    tid = make_task(root, "; ".join(writes), "greeting.txt", "src")
    assert fila(root, "apply", tid, "--yes", "--branch", "fila/bytes").exit_code == 0

    def blob(path: str) -> bytes:
        return subprocess.run(
            ["git", "-C", str(root.path), "cat-file", "blob", f"fila/bytes:{path}"],
            check=True,
            capture_output=True,
        ).stdout

    assert blob("greeting.txt") == b"plain\n"  # allowed: plain text as written
    assert blob("src/app.cfg") == b"allow = no\r\n"  # not converted to LF
    assert blob("src/enc.cfg") == "mode\n".encode("utf-16-le")  # not re-encoded to UTF-8
    assert blob("src/low.up") == b"lower\n"  # no filter ran
    assert git(root, "diff", "--stat", "HEAD", "fila/bytes", "--", "src/app.py") == ""  # untouched kept
    # the check before update-ref: a tree that differs elsewhere, or holds other bytes, is refused
    on = OnBranch(root.path, root.path, "", "x", git(root, "rev-parse", "HEAD").strip())
    tree = git(root, "rev-parse", "fila/bytes^{tree}").strip()
    changed = set(git(root, "diff", "--name-only", "-z", "HEAD", "fila/bytes").encode().split(b"\0")) - {b""}
    blob = git(root, "rev-parse", "fila/bytes:greeting.txt").strip()
    on.check_tree(tree, {b"greeting.txt": ("100644", blob, hashlib.sha256(b"plain\n").hexdigest())}, changed)
    with pytest.raises(ApplyRefused, match=r"src/app\.cfg"):
        on.check_tree(tree, {}, changed - {b"src/app.cfg"})
    with pytest.raises(ApplyRefused, match=r"greeting\.txt"):
        on.check_tree(tree, {b"greeting.txt": ("100644", blob, "0" * 64)}, changed)


def test_an_existing_or_invalid_branch_and_a_moved_head_are_refused_recording_nothing(root: Root) -> None:
    tid = make_task(root, "echo world > greeting.txt")
    git(root, "branch", "taken")
    refused = [("taken", "exists"), ("bad..name", "not a valid"), ("-x", "not a valid")]
    refused += [(n, "not a valid") for n in ("@", "@{-1}", "x@{1}", "HEAD", "refs/heads/main")]
    refused += [("TAKEN", "collides with the branch 'taken'"), ("taken/x", "collides")]
    for name, why in refused:
        res = fila(root, "apply", tid, "--yes", "--branch", name)
        assert res.exit_code == 2 and why in res.output, res.output
        assert record(root, tid)["status"] == "needs_review"
    (root.path / "greeting.txt").write_text("moved\n")
    git(root, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qam", "moved")
    res = fila(root, "apply", tid, "--yes", "--branch", "fila/moved")
    assert res.exit_code == 4 and "moved" in res.output, res.output
    assert "fila/moved" not in git(root, "branch") and record(root, tid)["status"] == "needs_review"
    git(root, "reset", "-q", "--hard", "HEAD^")
    assert fila(root, "apply", tid, "--yes", "--branch", "fila/ok").exit_code == 0  # HEAD as the task saw it


def test_outside_a_git_checkout_branch_is_refused(tmp_path: Path) -> None:
    plain = make_project(tmp_path / "plain")
    tid = make_task(plain, "echo world > greeting.txt")
    res = fila(plain, "apply", tid, "--yes", "--branch", "x")
    assert res.exit_code == 2 and "not in a git checkout" in res.output
    assert fila(plain, "apply", tid, "--yes").exit_code == 0


def test_the_page_applies_on_a_new_branch(root: Root) -> None:
    tid = make_task(root, "echo page > greeting.txt")
    c = client(root)
    page = c.get(f"/task/{tid}")
    form = apply_form(page.text, branch="review/page", reason="ok\x1b[2J\u202e")
    r = c.post(f"/task/{tid}/apply", data=form, headers={"Origin": "http://127.0.0.1"})
    assert r.status_code == 303, r.text
    assert "on the new branch review/page" in c.get(f"/task/{tid}").text
    assert git(root, "show", "review/page:greeting.txt") == "page\n"
    msg = git(root, "log", "-1", "--format=%B", "review/page")
    assert "ok[2J" in msg and "\x1b" not in msg and "\u202e" not in msg  # the note, without controls
    assert (root.path / "greeting.txt").read_text() == "hello\n"

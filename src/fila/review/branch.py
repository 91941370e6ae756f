"""`fila apply ID --branch NAME`: the reviewed patch as a commit on a new branch of the project's
git checkout, the checked-out branch and the working tree untouched, ready for a forge's pull
request (docs/review-web.md, "Apply on a branch").

The patch lands through apply's own recipe (review/apply.py: every check, --3way, credentials, a
compare group's supersedes, the decision recorded by the book) into a temporary worktree of the
checkout at HEAD (`git worktree add --detach`), under the task's meta directory; there the
touched files' bytes are hashed without any git filter into a temporary index over HEAD's tree,
the tree checked against what apply landed, and committed with `commit-tree` (no hook runs) with
trailers naming the task, the patch's sha256, the signed run statement when there is one
(docs/provenance.md, "Into the project's history") and the reviewer, and `refs/heads/NAME` is created
only if it does not exist (update-ref with an empty old value). Only then is the decision
recorded; a failure before takes the landing back and records nothing. The worktree goes in
every case. The base the patch must fit is HEAD's files (the moved-base check reads the
worktree): a checkout whose HEAD differs from what the task copied refuses unless --3way merges
cleanly.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.errors import ApplyRefused, InfraError, InvalidInput
from ..core.layout import Root
from ..core.models import Record
from ..core.text import invisible
from ..workspace.fswalk import escape_name
from ..workspace.hardgit import tail
from .apply import Applied
from .landing import Op

# No hook runs, nothing asks a terminal, and the checkout's own settings stay its own: the
# worktree is checked out as the person's git would, and the commit is made without hooks.
_SAFE = ("-c", "core.hooksPath=/dev/null", "-c", "commit.gpgSign=false")


def git(
    repo: Path, *args: str, check: bool = True, stdin: bytes | None = None, index: Path | None = None
) -> subprocess.CompletedProcess[bytes]:
    """git in `repo` (`index`: a temporary index file instead of the repository's)."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"}
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(k, None)
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    try:
        res = subprocess.run(
            ["git", *_SAFE, "-C", str(repo), *args], env=env, capture_output=True, timeout=600, input=stdin
        )
    except FileNotFoundError:
        raise InfraError("git is not installed", hint="install git; `--branch` commits with it") from None
    if check and res.returncode != 0:
        raise ApplyRefused(f"git {args[0]} failed in {repo}: {tail(res.stderr)}")
    return res


def check_branch(top: Path, name: str) -> None:
    """A name git accepts as `refs/heads/NAME` taken literally (no `@`, `@{...}`, `HEAD`, leading
    `refs/` or `-`, which git would expand or read as something else), and no branch of that name
    yet, nor one that differs only in case (two such branches are one file on a case-insensitive
    disk) or that holds it as a directory or a file (`a` beside `a/b`)."""
    taken_literally = name not in ("@", "HEAD") and "@{" not in name
    if (
        not taken_literally
        or name.startswith(("-", "refs/"))
        or git(top, "check-ref-format", f"refs/heads/{name}", check=False).returncode != 0
    ):
        raise InvalidInput(f"{name!r} is not a valid git branch name", hint="e.g. --branch fila/TASK-ID")
    have = git(top, "for-each-ref", "--format=%(refname)", "refs/heads/").stdout.decode(errors="replace")
    folded = name.casefold()
    for ref in have.splitlines():
        other = ref.removeprefix("refs/heads/")
        o = other.casefold()
        if o == folded or o.startswith(folded + "/") or folded.startswith(o + "/"):
            said = f"exists in {top}" if other == name else f"collides with the branch {other!r} in {top}"
            raise InvalidInput(f"branch {name!r} {said}", hint="name a new branch; fila never moves one")


def printable(text: str) -> str:
    """`text` without control, bidi or other unprintable characters (lines kept): what a commit
    message takes from an engine's prompt or a reviewer's note."""
    return "".join(c for c in text if c == "\n" or not invisible(c))


@dataclass
class OnBranch:
    """apply.Landing: a worktree of the checkout at HEAD, and the commit on `branch`."""

    top: Path  # the checkout's top directory
    tree: Path  # the temporary worktree
    prefix: str  # the project's path inside the checkout ("" at its top)
    branch: str
    base: str  # HEAD's commit
    commit: str | None = None

    @property
    def project(self) -> Path:
        return self.tree / self.prefix if self.prefix else self.tree

    def landed(self, rec: Record, by: str, reason: str | None, ops: list[Op], run: bytes | None) -> str:
        tree = self.tree_of(ops)
        subject = f"fila: task {rec.id}" + (f" ({rec.engine})" if rec.engine else "")
        body = printable((rec.task.prompt if rec.task else "")[:2000])
        trailers = f"Fila-Task: {rec.id}\nFila-Patch-Sha256: {rec.patch_sha256}\n"
        if run is not None:  # the signed run statement, as `fila apply --attestations` writes it
            trailers += f"Fila-Provenance: sha256:{hashlib.sha256(run).hexdigest()}\n"
        trailers += f"Reviewed-by: {by}\n"
        msg = (
            subject
            + "\n\n"
            + (body.strip() + "\n\n" if body.strip() else "")
            + printable(reason or "").strip()
        )
        msg = msg.rstrip() + "\n\n" + trailers
        self.commit = git(self.tree, "commit-tree", tree, "-p", self.base, "-m", msg).stdout.decode().strip()
        # An empty old value: created only if no branch of that name appeared meanwhile.
        git(
            self.top, "update-ref", "-m", f"fila apply {rec.id}", f"refs/heads/{self.branch}", self.commit, ""
        )
        return f"committed as {self.commit} on the new branch {self.branch} of {self.top}"

    def tree_of(self, ops: list[Op]) -> str:
        """HEAD's tree with each touched path set to the bytes the apply landed, read without any
        filter: no .gitattributes (the patch's own included), no end-of-line conversion, no filter
        driver of the checkout's config changes a byte between the review and the commit. A
        temporary index, never the checkout's; the tree is then checked against `ops`."""
        index = self.tree.parent / "branch.index"
        index.unlink(missing_ok=True)
        want: dict[bytes, tuple[str, str, str]] = {}  # path: (mode, blob, sha256 of its bytes)
        entries, zero = [], "0" * len(self.base)
        try:
            git(self.tree, "read-tree", self.base, index=index)
            for op in sorted(ops, key=lambda o: o.after.kind in ("file", "symlink")):  # removals first
                name, where = self.name_of(op), self.project / op.path
                if op.after.kind == "file":
                    blob = git(self.tree, "hash-object", "-w", "--no-filters", "--", str(where))
                    mode = "100755" if op.after.mode & 0o111 else "100644"
                elif op.after.kind == "symlink":
                    target = os.fsencode(os.readlink(where))
                    blob = git(self.tree, "hash-object", "-w", "--no-filters", "--stdin", stdin=target)
                    mode = "120000"
                else:  # absent, or a directory (its files are ops of their own)
                    entries.append(f"0 {zero}\t".encode() + name + b"\0")
                    continue
                want[name] = (mode, blob.stdout.decode().strip(), op.after.sha256)
                entries.append(f"{mode} {want[name][1]}\t".encode() + name + b"\0")
            git(self.tree, "update-index", "-z", "--index-info", stdin=b"".join(entries), index=index)
            tree = git(self.tree, "write-tree", index=index).stdout.decode().strip()
        finally:
            index.unlink(missing_ok=True)
        self.check_tree(tree, want, {self.name_of(op) for op in ops})
        return tree

    def name_of(self, op: Op) -> bytes:
        """The op's path in the checkout's tree."""
        return os.fsencode(f"{self.prefix}/{op.path}" if self.prefix else op.path)

    def check_tree(self, tree: str, want: dict[bytes, tuple[str, str, str]], touched: set[bytes]) -> None:
        """The tree differs from HEAD's only at touched paths, each holding the blob and mode put
        there, whose bytes hash to the sha256 the apply checked against the reviewed patch."""
        raw = git(self.tree, "diff-tree", "-r", "-z", "--no-renames", self.base, tree).stdout.split(b"\0")
        bad = []
        for meta, name in zip(raw[0::2], raw[1::2], strict=False):
            _old_mode, new_mode, _old, new, _kind = meta.decode().lstrip(":").split(" ")
            got = want.get(name)
            if name not in touched or (got is not None and got[:2] != (new_mode, new)):
                bad.append(name)
        for name, (_mode, sha, sha256) in want.items():
            if hashlib.sha256(git(self.tree, "cat-file", "blob", sha).stdout).hexdigest() != sha256:
                bad.append(name)
        if bad:
            raise ApplyRefused(
                "the commit would not hold the reviewed bytes at "
                + ", ".join(escape_name(os.fsdecode(n)) for n in bad[:20]),
                hint="nothing was committed; apply without --branch, or report it",
            )


def apply_on_branch(
    root: Root, db: Any, task_id: str, branch: str, **options: Any
) -> tuple[Applied, OnBranch]:
    """The task's patch committed on the new branch `branch` of the git checkout holding its
    project (the file queue's: the job's manifest's; a PostgreSQL queue's: `root`, as `apply
    --queue` lands); see the module doc. `options` are apply's. Returns apply's result (its
    project the worktree, gone now) and the branch with its commit."""
    from . import desk, report

    project = (
        root.path
        if db is not None
        else Path(report.project_path(root.require(), desk.record(root, None, task_id)))
    )
    res = git(project, "rev-parse", "--show-toplevel", check=False)
    if res.returncode != 0:
        raise InvalidInput(
            f"{project} is not in a git checkout", hint="--branch commits in the project's git checkout"
        )
    top = Path(res.stdout.decode().strip()).resolve()
    prefix = project.resolve().relative_to(top).as_posix() if project.resolve() != top else ""
    check_branch(top, branch)
    head = git(top, "rev-parse", "--verify", "HEAD^{commit}", check=False)
    if head.returncode != 0:
        raise InvalidInput(
            f"the checkout {top} has no commit yet", hint="commit once, then apply on a branch"
        )
    where = root.meta(task_id) / "branch"
    if where.exists():
        git(top, "worktree", "remove", "--force", str(where), check=False)
        fsutil.remove_tree(where)
    where.parent.mkdir(parents=True, exist_ok=True)
    on = OnBranch(top, where, prefix, branch, head.stdout.decode().strip())
    git(top, "worktree", "add", "--detach", "--quiet", str(where), on.base)
    try:
        return desk.apply_task(root, db, task_id, into=on, **options), on
    finally:
        git(top, "worktree", "remove", "--force", str(where), check=False)
        if where.exists():
            fsutil.remove_tree(where)
        git(top, "worktree", "prune", check=False)

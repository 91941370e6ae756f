"""Landing a checked change in the project, and taking it back (the last steps of `fila apply`).

`land` writes each path's `after` state (deletions first, deepest first; then files and symlinks,
shallowest first, creating missing directories), through `SafeDir`, so nothing is written through
a symlink and every file is renamed into place whole. It is idempotent: a path already in its
`after` state is skipped. If any step fails, every path already written is put back from the
staging copy of its `before` state (content and permission bits), created directories are
removed and removed ones made again.

The marker `sandbox/meta/<id>/applying.json`, written before the first write and removed once
the decision is recorded, lists every path with both states, so an apply killed in between can be
finished (`apply` runs `land` again) or, if nothing landed yet, dropped (`reject`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..core import fsutil
from ..core.errors import ApplyRefused, FilaError
from ..core.faults import crash_point
from ..core.layout import Root
from ..queue import store as queue
from ..workspace.fswalk import escape_name
from ..workspace.safedir import SafeDir, State

MARKER = "applying.json"
_MAX_LISTED = 20
ANY_SIZE = 1 << 62  # sizes were checked when staged; the landing only re-reads its own copies


@dataclass
class Op:
    """One touched path: what the project holds there now, and what it will hold."""

    path: str
    before: State
    after: State
    perm: int | None = None  # the file's exact permission bits before, to put it back as it was

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
            "perm": self.perm,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Op:
        return cls(d["path"], State.from_json(d["before"]), State.from_json(d["after"]), d["perm"])


def refuse(msg: str, tid: str, items: list[str] | None = None, **kw: Any) -> ApplyRefused:
    """An ApplyRefused listing `items` (escaped, at most 20), one per line."""
    if items:
        shown = [escape_name(i) for i in items[:_MAX_LISTED]]
        more = f"\n  ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
        msg += ":\n  " + "\n  ".join(shown) + more + "\n"
    kw.setdefault("hint", "nothing was written to the project")
    return ApplyRefused(msg, task_id=tid, **kw)


def done(cur: State, want: State) -> bool:
    return cur == want or (cur.kind in ("absent", "dir") and want.kind in ("absent", "dir"))


Where = Literal["after", "before", "absent", "other"]


def classify(proj: SafeDir, op: Op) -> Where:
    """Where `op.path` stands in the project now: in its `after` state ("after"), in its
    `before` state ("before"), missing though it was a file or symlink before ("absent"), or
    anything else ("other": someone else wrote it). A directory and no entry count as the same
    state (`done`): the landing makes and removes directories itself. The landing, its resume,
    its rollback and a lost reply's check (review/remote.py) all decide from this answer."""
    cur = proj.state(op.path, max_bytes=ANY_SIZE)
    if done(cur, op.after):
        return "after"
    if done(cur, op.before):
        return "before"
    return "absent" if cur.kind == "absent" else "other"


def land(proj: SafeDir, ops: list[Op], staging: Path, tid: str, root: Root, *,
         resuming: bool = False) -> tuple[list[str], list[str]]:  # fmt: skip
    """Write every op's `after` state; on any failure, put back what was written and re-raise.

    Idempotent: a path already in its `after` state is skipped, so a retry after a crash finishes
    the job. A path in neither its `before` nor its `after` state is refused.
    """
    undo: list[tuple[str, Any]] = []
    written: list[str] = []
    deleted: list[str] = []
    depth = lambda op: op.path.count("/")  # noqa: E731
    dels = sorted((op for op in ops if op.after.kind in ("absent", "dir")), key=depth, reverse=True)
    puts = sorted((op for op in ops if op.after.kind in ("file", "symlink")), key=depth)
    keep = {"/".join(op.path.split("/")[:i]) for op in puts for i in range(1, op.path.count("/") + 1)}
    try:
        with SafeDir(staging / "after") as adir:
            for op in dels:
                where = classify(proj, op)
                if where == "after":
                    continue
                if where != "before":
                    raise _changed(proj, op, tid)
                proj.unlink(op.path)
                undo.append(("restore", op))
                deleted.append(escape_name(op.path))
            emptied = {"/".join(op.path.split("/")[:i]) for op in dels
                       for i in range(1, op.path.count("/") + 1)} - keep  # fmt: skip
            for d in sorted(emptied, key=lambda d: d.count("/"), reverse=True):
                if proj.rmdir(d):
                    undo.append(("mkdir", d))
            for op in puts:
                where = classify(proj, op)
                if where == "after":
                    continue
                if where == "other":
                    raise _changed(proj, op, tid)
                made: list[str] = []
                try:
                    _put(adir, proj, op.path, op.after, made)
                finally:
                    undo += [("rmdir", d) for d in made]
                undo.append(("restore", op))
                written.append(escape_name(op.path))
                crash_point("apply_after_write")
    except BaseException as err:
        problems = _rollback(proj, undo, staging)
        queue.log_event(root, tid, "apply rolled back", error=str(err), problems=problems)
        if not problems and not resuming:
            clear(root, tid)  # back as it was; a resumed apply keeps what the first run wrote
        if isinstance(err, FilaError):
            raise
        if isinstance(err, OSError):
            raise refuse(f"writing the project failed ({err}); every file was put back" if not
                         problems else f"writing the project failed ({err}) and putting files back "
                         f"failed too: {'; '.join(problems)}", tid,
                         hint="nothing was written" if not problems else
                         "run `fila apply ID` again to finish, see `fila show ID`") from None  # fmt: skip
        raise
    return written, deleted


def _changed(proj: SafeDir, op: Op, tid: str) -> ApplyRefused:
    cur = proj.state(op.path, max_bytes=ANY_SIZE)
    return refuse(f"{escape_name(op.path)} changed while being applied "
                  f"(expected {op.before.show()}, found {cur.show()})", tid)  # fmt: skip


def _put(src: SafeDir, dst: SafeDir, rel: str, state: State, made: list[str],
         perm: int | None = None) -> None:  # fmt: skip
    """Copy `rel` from staging into the project; the copy must be `state` (it is compared after
    writing: a failure then rolls back)."""
    if src.copy_to(rel, dst, max_bytes=ANY_SIZE, made=made, mode=perm) != state:
        raise FilaError(
            f"the staged copy of {escape_name(rel)} is not what was checked", path=escape_name(rel)
        )


def _rollback(proj: SafeDir, undo: list[tuple[str, Any]], staging: Path) -> list[str]:
    problems = []
    with SafeDir(staging / "before") as bdir:
        for what, arg in reversed(undo):
            try:
                if what == "rmdir":
                    proj.rmdir(arg)
                elif what == "mkdir":
                    proj.mkdir(arg)
                elif arg.before.kind in ("file", "symlink"):
                    _put(bdir, proj, arg.path, arg.before, [], arg.perm)
                elif proj.lstat(arg.path) is not None:
                    proj.unlink(arg.path)
            except (OSError, FilaError) as e:
                problems.append(f"{escape_name(arg if isinstance(arg, str) else arg.path)}: {e}")
    return problems


def marker_path(root: Root, task_id: str) -> Path:
    return root.meta(task_id) / MARKER


def read_marker(root: Root, task_id: str) -> dict[str, Any] | None:
    try:
        return json.loads(marker_path(root, task_id).read_text())
    except FileNotFoundError:
        return None


def write_marker(root: Root, task_id: str, patch_sha256: str | None, project: Path, ops: list[Op],
                 merged: list[str]) -> None:  # fmt: skip
    # ensure_ascii (the default) keeps names that are not UTF-8 (surrogates) as \\udcNN escapes.
    fsutil.atomic_write(
        marker_path(root, task_id),
        json.dumps(
            {
                "patch_sha256": patch_sha256,
                "project": str(project),
                "merged": merged,
                "ops": [op.to_json() for op in ops],
            },
            indent=1,
        ),
    )


def clear(root: Root, task_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(marker_path(root, task_id))
    shutil.rmtree(root.meta(task_id) / "apply", ignore_errors=True)


def roll_back(root: Root, task_id: str) -> list[str]:
    """Take a landing back after its decision was refused (a race lost, a crash then another
    member applied, a reject from another host meanwhile): every path its marker lists that holds
    its `after` state gets its `before` state again from `staging/before` (content and permission
    bits), then the marker and staging go. Returns the escaped names put back; a path in neither
    state is left as it is and refuses (ApplyRefused listing it, marker kept) so nothing a person
    wrote since is overwritten. Directories the landing created stay (they may hold other files).
    No marker: nothing to do. The caller logs it where its decisions go (decision.Book)."""
    marker = read_marker(root, task_id)
    if marker is None:
        return []
    ops = [Op.from_json(o) for o in marker["ops"]]
    staging = root.meta(task_id) / "apply"
    undo: list[tuple[str, Any]] = []
    odd: list[str] = []
    with SafeDir(Path(marker["project"])) as proj:
        for op in ops:
            where = classify(proj, op)
            if where == "after":
                undo.append(("restore", op))
            elif where != "before":
                odd.append(op.path)
        if odd:
            raise refuse("the decision was refused and these files are neither as they were nor "
                         "as the patch made them, so fila leaves them", task_id, odd,
                         hint=f"put them back by hand (their earlier contents are in {staging}/before), "
                         f"then delete {marker_path(root, task_id)}")  # fmt: skip
        problems = _rollback(proj, list(reversed(undo)), staging)
    if problems:
        raise refuse("the decision was refused and putting files back failed: " + "; ".join(problems),
                     task_id, hint=f"their earlier contents are in {staging}/before")  # fmt: skip
    clear(root, task_id)
    return [escape_name(op.path) for _w, op in undo]


def forget_untouched_interrupted(root: Root, task_id: str) -> None:
    """Before a reject: drop an interrupted apply's marker if it wrote nothing; refuse otherwise."""
    marker = read_marker(root, task_id)
    if marker is None:
        return
    ops = [Op.from_json(o) for o in marker["ops"]]
    with SafeDir(Path(marker["project"])) as proj:
        landed = [op.path for op in ops if proj.state(op.path, max_bytes=ANY_SIZE) != op.before]
    if landed:
        raise refuse("an interrupted apply already wrote some files of this task", task_id,
                     landed, hint="run `fila apply ID` to finish it; a task cannot be rejected "
                     "once its change is partly in the project")  # fmt: skip
    clear(root, task_id)
    queue.log_event(root, task_id, "interrupted apply dropped", reason="nothing was written")

"""A PostgreSQL runner's root: what it must be before a runner claims anything, and its mark
(docs/scale-out.md, "Running it"). The job roots under its `remote/` and their locks are
remote_jobs.py's.

A job root is laid out by its path, with the host's policies, config and secrets: a runner
refuses a root another user can write, and one whose own directories (`CHECKED`: fila/,
fila/state/, sandbox/, policies/, ...) are links or another user's, checked from the root's
directory without following a link (`check_root`: a project's `fila` linking to another root
would get the mark and the recovery lock); it takes group and other write from them (who can
write fila/state/ can plant and hold the recovery lock) and makes remote/ 0700 (tightened when it
was not) at its start and at every remote_jobs.take (`prepare`); the runner checks that the job
root is still the directory it made before it writes there (remote_jobs.Held.verify).

A root is a runner's once marked (`mark`: `<root>/fila/state/pg-runner`, written by `fila worker
--queue` at its start and by remote_jobs.take): only then does recovery touch its `remote/`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from ..core import fsutil
from ..core.errors import InfraError
from ..core.layout import Root

JOBS = "remote"  # the directory of a runner's job roots, under its root
MARK = "pg-runner"  # <root>/fila/state/pg-runner: this root is a PostgreSQL runner's
_MARK_TEXT = (
    "This queue root is a PostgreSQL runner's (`fila worker --queue`): recovery removes the job "
    "roots in remote/ whose runner is gone (docs/scale-out.md).\n"
)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a directory, never a link


def jobs_dir(root: Root) -> Path:
    return root.path / JOBS


def owned(st: os.stat_result, kind: int) -> bool:
    """Whether `st` is of file type `kind` (stat.S_IFDIR, S_IFREG) and this user's."""
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid()


def mark(root: Root) -> None:
    """Mark `root` as a PostgreSQL runner's, so recovery recovers its job roots (idempotent).
    InfraError when something other than this user's regular file is at the mark's name."""
    path = root.state_dir / MARK
    root.state_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        with contextlib.suppress(FileNotFoundError):
            if owned(os.lstat(path), stat.S_IFREG):
                return
            raise InfraError(
                f"{path} is not a regular file of this user's: this root cannot be marked as a "
                "PostgreSQL runner's, so its job roots would never be recovered",
                hint=f"remove {path}; `fila worker --queue` writes it again",
            )
        fsutil.create_exclusive(path, _MARK_TEXT)
    raise InfraError(f"{path} could not be written")  # removed twice meanwhile: not fila's doing


def marked(root: Root) -> bool:
    """Whether `root` is a PostgreSQL runner's (`mark`): only then does recovery touch remote/."""
    try:
        return owned(os.lstat(root.state_dir / MARK), stat.S_IFREG)
    except OSError:
        return False


# What a runner's root holds that a project could make a link, or another user's (a checkout
# carries symlinks): each checked from the root's directory, never through a link (`prepare`).
CHECKED = ("fila", "fila/state", "fila/in", "fila/out", "fila/run", "fila/logs", "fila/rejected",
           "fila/keys", "sandbox", "sandbox/jobs", "sandbox/meta", "sandbox/spares", "policies")  # fmt: skip


def prepare(root: Root) -> Path:
    """What a runner needs of its root before it claims anything (`fila worker --queue` at its
    start, and `take`): a root no other user can write (who
    can, can put a directory of theirs where remote/ is); its own directories (`CHECKED`) each a
    directory of this user's reached without a link (a project's `fila` or `sandbox` that links
    elsewhere would have the runner write its mark, its recovery lock and its jobs there) and
    tightened to no group/other write when they are this user's (who can write fila/state/ can
    plant and hold its recovery lock); the root marked (`mark`); remote/ a directory of this
    user's that only this user can reach: made 0700 if missing, tightened to 0700 if group or
    others had a way in (as Root.require does for the sandbox's directories), since a job root is
    laid out by its path and its policies, config and secrets are the host's. remote/; InfraError
    saying which and what to do when it cannot be so."""
    check_root(root)
    mark(root)
    d = jobs_dir(root)
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700)
    try:
        fd = os.open(d, DIR_FLAGS)  # never through a link: the mode is set on what was checked
    except OSError:
        fd = -1
    try:
        if fd < 0 or not owned(os.fstat(fd), stat.S_IFDIR):
            raise InfraError(
                f"{d} is not a directory of this user's (a link, a file, or another user's): no job "
                "root is made there",
                hint="move it away: a runner's --root keeps remote/ for its job roots and makes it again",
            )
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        if fd >= 0:
            os.close(fd)
    return d


def check_root(root: Root) -> None:
    """`prepare`'s checks of the root and its own directories (`CHECKED`), nothing written but
    group/other write taken away: for a runner to call before anything else touches its root
    (Root.require makes directories by their paths, through a link). InfraError as `prepare`."""
    try:
        top = os.open(root.path, DIR_FLAGS)
    except OSError as e:
        raise InfraError(
            f"{root.path}: {e.strerror or e}", hint="give the runner a directory as --root"
        ) from None
    try:
        st = os.fstat(top)
        if st.st_mode & 0o022 or st.st_uid != os.getuid():
            raise InfraError(
                f"{root.path} (mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}) can be written by another "
                "user: a runner lays its jobs out under it, with this host's policies, config and secrets",
                hint=f"`chmod go-w {root.path}` (as its owner), or give the runner a --root of its own",
            )
        for rel in CHECKED:
            # fila/state/ holds the recovery lock: one another user can open (an earlier fila made
            # it 0644), it can flock and hold, so nobody else reaches that directory at all; nor
            # fila/keys/, the host's signing key (docs/provenance.md).
            _own_dir(top, root.path, rel, 0o077 if rel in ("fila/state", "fila/keys") else 0o022)
    finally:
        os.close(top)


def _own_dir(top: int, base: Path, rel: str, strip: int = 0o022) -> None:
    """`rel` under the root (`top`, its directory), when it is there, a directory of this user's,
    each step opened without following a link, its group/other write taken away (`strip`: the
    mode bits taken from `rel` itself). Nothing is made
    here: what is missing, Root.require makes (a directory that is not a queue root stays one)."""
    fds = [os.dup(top)]
    try:
        parts = rel.split("/")
        for i, part in enumerate(parts):
            mask = strip if i == len(parts) - 1 else 0o022  # `strip` of `rel` itself
            try:
                fd = os.open(part, DIR_FLAGS, dir_fd=fds[-1])
            except FileNotFoundError:
                return
            except OSError as e:  # a link or a file (ENOTDIR, ELOOP)
                link = stat.S_ISLNK(os.stat(part, dir_fd=fds[-1], follow_symlinks=False).st_mode)
                raise _not_own(base / rel, "a link" if link else e.strerror or str(e)) from None
            fds.append(fd)
            st = os.fstat(fd)
            if not owned(st, stat.S_IFDIR):
                raise _not_own(base / rel, f"uid {st.st_uid}")
            if st.st_mode & mask:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~mask)
    except OSError as e:
        raise InfraError(f"{base / rel}: {e.strerror or e}") from None
    finally:
        for fd in fds:
            os.close(fd)


def _not_own(path: Path, why: str) -> InfraError:
    return InfraError(
        f"{path} is not a directory of this user's reached without a link ({why}): a runner keeps "
        "its own state there, so it is not used",
        hint=f"move {path} away (it is made again), or give the runner a --root of its own, not a "
        "project's checkout",
    )

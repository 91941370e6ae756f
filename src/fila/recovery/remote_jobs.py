"""A PostgreSQL runner's job roots and their locks (docs/scale-out.md, "Running it").

A runner of the PostgreSQL queue (run/remote.py) runs each claim in a job root of its own,
`<root>/remote/<id>.<token>` (a queue root: the job's local journal, its work and logs), and runs
its container with that job root's labels. Who may remove a job root, and when:

- **The runner that made it, while it lives.** Before the job root exists, the runner takes its
  lock, `<root>/remote/.<id>.<token>.lock` (hidden, beside it): an exclusive flock, taken on a
  temporary name and only then linked to its own (never over an existing one), so nobody ever
  sees the lock free while its taker lives; a directory of that name there already is refused
  (not made by this lock's holder). It holds the lock for the job's whole life and lets it go
  (`Held.release`) only after it removed the job root (the lock file unlinked while still held,
  then closed), or kept it with its containers stopped (a lost lease: what it holds is evidence,
  until the next recovery; the lock file stays, free, and marks the job root as a runner's).
- **Nobody else.** A directory under `remote/` without its lock file is not a job root of this
  fila's (a project's own `remote/` directory, if a runner's `--root` is a project): never
  touched.
- **Recovery, once nobody holds the lock** (recover.py: at a runner's start and in every `fila
  recover --root`). The kernel drops a flock when its process dies, however it dies (SIGKILL
  included), so on this host a free lock proves the job's runner is gone; a runner's root is a
  local directory (over NFS a flock proves nothing). Recovery takes the free lock itself
  (`free`, never blocking) and holds it while it stops and removes the job root's containers,
  gateway and networks and then the job root; a held lock (a live runner's job, on this root or
  from another process) is skipped. The job root goes only once the container engine has
  confirmed that no container of it is left; until then it and its lock file stay, for a later
  pass. One recovery at a time per root (the root's recovery lock) decides each job root once.

Nothing here publishes or decides anything in the queue database: the claim's lease does
(a sweep requeues the task within its retry budget before its started mark, needs_human after).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from ..core.errors import InfraError
from ..core.fsutil import file_lock
from ..core.layout import Root
from ..core.states import valid_id

JOBS = "remote"  # the directory of a runner's job roots, under its root


def jobs_dir(root: Root) -> Path:
    return root.path / JOBS


def job_name(task_id: str, token: int) -> str:
    """The job root's name: the task and the claim's fencing token (unique per claim)."""
    return f"{task_id}.{token}"


def is_job_name(name: str) -> bool:
    tid, dot, token = name.rpartition(".")
    return bool(dot) and token.isdigit() and valid_id(tid)


def lock_path(root: Root, name: str) -> Path:
    return jobs_dir(root) / f".{name}.lock"


class Held:
    """A job root's lock while its runner holds it (`path`: the job root, not made yet when the
    lock is taken); `release` once the job root is removed, or kept with its containers stopped
    (idempotent)."""

    def __init__(self, lock: Path, fd: int, path: Path) -> None:
        self.lock, self.path, self._fd = lock, path, fd
        self._done = threading.Lock()

    def release(self) -> None:
        """The job root gone: its lock file unlinked while still held (nobody sees it free and
        named), then closed. The job root kept: closed only, so the lock file, free now, still
        marks it as a runner's for the next recovery."""
        if self._done.acquire(blocking=False):
            if not (self.path.exists() or self.path.is_symlink()):
                with contextlib.suppress(FileNotFoundError):
                    self.lock.unlink()
            os.close(self._fd)


def take(root: Root, name: str) -> Held:
    """The lock of job root `name`, taken before the job root exists. InfraError when a lock of
    that name exists already (a job root of the same claim, which no runner makes twice), or a
    directory of that name without it (not a runner's: left as it is)."""
    d = jobs_dir(root)
    d.mkdir(parents=True, exist_ok=True)
    lock = lock_path(root, name)
    tmp = d / f"{lock.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held before it has its name: never seen free while we live
        try:
            os.link(tmp, lock)  # unlike a rename, never replaces a lock someone holds
        except FileExistsError:
            raise InfraError(
                f"the job root lock {lock} exists already: another process made this claim's job root",
                hint=f"`fila recover --root {root.path}` removes it once nobody holds it",
            ) from None
        finally:
            os.unlink(tmp)
        path = d / name
        if path.exists() or path.is_symlink():
            lock.unlink()
            raise InfraError(
                f"{path} exists without its lock: it is not a job root this runner made, so it is "
                "left as it is and this claim is not run there",
                hint="move it away: the runner's --root keeps remote/ for its job roots",
            )
    except BaseException:
        os.close(fd)
        raise
    return Held(lock, fd, path)


def names(root: Root) -> list[str]:
    """The job roots under `root`, by their lock files (a job root may be gone already, or not
    made yet); temp locks of a killed taker that nobody holds are removed here."""
    found: set[str] = set()
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for p in jobs_dir(root).iterdir():
            if not p.name.startswith("."):
                continue
            if p.name.endswith(".tmp"):
                _clear_temp(p)
            elif p.name.endswith(".lock") and is_job_name(p.name[1 : -len(".lock")]):
                found.add(p.name[1 : -len(".lock")])
    return sorted(found)


@contextlib.contextmanager
def free(root: Root, name: str) -> Iterator[bool]:
    """Job root `name`'s lock for the block when nobody holds it (yields True: the caller may
    remove the job root, then `forget` it); False when a live process holds it, or when there
    is no lock file (released meanwhile with its job root removed; or never a runner's)."""
    lock = lock_path(root, name)
    with contextlib.ExitStack() as stack:
        try:
            held = stack.enter_context(file_lock(lock, wait=False, create=False))
        except FileNotFoundError:
            held = False
        yield held


def forget(root: Root, name: str) -> None:
    """The lock file of a job root that is gone (called while `free` holds it)."""
    with contextlib.suppress(FileNotFoundError):
        lock_path(root, name).unlink()


def _clear_temp(p: Path) -> None:
    with contextlib.suppress(FileNotFoundError), file_lock(p, wait=False, create=False) as held:
        if held:
            p.unlink()

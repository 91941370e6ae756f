"""A PostgreSQL runner's job roots and their locks (docs/scale-out.md, "Running it").

A runner of the PostgreSQL queue (run/remote.py) runs each claim in a job root of its own,
`<root>/remote/<id>.<token>` (a queue root: the job's local journal, its work and logs), and runs
its container with that job root's labels. Who may remove a job root, and when:

- **The runner that made it, while it lives.** Before the job root exists, the runner takes its
  lock, `<root>/remote/.<id>.<token>.lock` (hidden, beside it): an exclusive flock on a file
  with no name yet (O_TMPFILE) that holds a random mark, linked to its name only once locked and
  never over an existing one, so nobody ever sees the lock free while its taker lives. The
  runner then makes the job root (0700; never over something at its name) and writes the same
  mark inside it (`<job root>/fila/state/job-root`): a lock and a directory that were not made
  together never match. It holds the lock for the job's whole life and lets it go
  (`Held.release`) only after it removed the job root (the lock file unlinked while still held,
  then closed), or kept it (containers it could not confirm gone, a lost lease: what it holds is
  for recovery; the lock file stays, free). A removal, the runner's or recovery's, first renames
  the job root to `.<id>.<token>.removing` (`remove`): one killed part-way leaves that hidden
  name and the lock file, and the next recovery finishes it.
- **Only this user reaches remote/** (runner_root.py: the root's checks, `prepare`).
- **Nobody else.** What the runner did not make is never touched: a directory without its lock
  file, a lock or job root that is a link, a directory or another user's, a job root whose mark
  differs from its lock's (a project's own `remote/`, names planted there), and what git could
  carry: a runner's remote/ and job roots are 0700 and its locks 0600, where git stores no
  directory mode and only 0644/0755 files, so a checkout's remote/ with matching marks is not a
  runner's. Such a job root is left as it is and said, by its path, in recovery's report (`names`:
  a job root or the rest of a removal without its lock too); docs/scale-out.md says how a person
  removes one.
- **Recovery, once nobody holds the lock** (recover.py: at a runner's start and in every `fila
  recover --root`), and only on a root marked as a runner's (`mark`: `<root>/fila/state/pg-runner`,
  written by `fila worker --queue` at its start and by `take`): a file queue root or a project
  never gets this pass. The kernel drops a flock when its process dies, however it dies
  (SIGKILL included), so on this host a free lock proves the job's runner is gone; a runner's
  root is a local directory (over NFS a flock proves nothing). Recovery takes the free lock
  itself (`free`, never blocking) and holds it while it stops and removes the job root's
  containers, gateway and networks and then the job root; a held lock (a live runner's job, on
  this root or from another process) is skipped. The job root goes only once the container
  engine has confirmed that no container of it is left; until then it and its lock file stay,
  for a later pass. One recovery at a time per root (the root's recovery lock) decides each job
  root once.

Nothing here publishes or decides anything in the queue database: the claim's lease does
(a sweep requeues the task within its retry budget before its started mark, needs_human after).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from ..core import fsutil
from ..core.errors import FilaError, InfraError
from ..core.layout import Root
from ..core.states import valid_id
from .runner_root import DIR_FLAGS, jobs_dir, owned, prepare

PROOF = "job-root"  # <job root>/fila/state/job-root: the mark of the lock that made it
_NONCE = re.compile(rb"[0-9a-f]{32}")
# A lock file not linked yet, where O_TMPFILE is not supported: `.<name>.lock.<pid>.<thread>.tmp`.
_TEMP = re.compile(r"\.(?P<name>.+)\.lock\.(?P<pid>[0-9]+)\.[0-9]+\.tmp")


def job_name(task_id: str, token: int) -> str:
    """The job root's name: the task and the claim's fencing token (unique per claim)."""
    return f"{task_id}.{token}"


def is_job_name(name: str) -> bool:
    tid, dot, token = name.rpartition(".")
    return bool(dot) and token.isdigit() and valid_id(tid)


def lock_path(root: Root, name: str) -> Path:
    return jobs_dir(root) / f".{name}.lock"


def removing(path: Path) -> Path:
    """Where job root `path` is while it is being removed (`remove`): `.<name>.removing` beside it."""
    return path.with_name(f".{path.name}.removing")


class Held:
    """A job root's lock while its runner holds it (`path`: the job root, `made`: its device and
    inode as `take` made it); `release` once the job root is removed, or kept for recovery
    (idempotent)."""

    def __init__(self, lock: Path, fd: int, path: Path, made: tuple[int, int]) -> None:
        self.lock, self.path, self.made, self._fd = lock, path, made, fd
        self._done = threading.Lock()

    def verify(self) -> None:
        """InfraError unless `path` is still the directory `take` made (not a link, the same
        device and inode): what the runner writes there goes nowhere else."""
        try:
            st = os.lstat(self.path)
        except OSError as e:
            raise InfraError(f"the job root {self.path}: {e.strerror or e}") from None
        if not owned(st, stat.S_IFDIR) or (st.st_dev, st.st_ino) != self.made:
            raise InfraError(
                f"the job root {self.path} is no longer the directory this runner made (replaced, or a "
                "link): nothing is written there",
                hint="someone else can write in remote/: give the runner a --root only its user can write",
            )

    def release(self) -> None:
        """The job root gone (and the rest of its removal, `removing`): its lock file unlinked
        while still held (nobody sees it free and named), then closed. The job root kept: closed
        only, so the lock file, free now, still marks it as a runner's for the next recovery."""
        if self._done.acquire(blocking=False):
            if not any(os.path.lexists(p) for p in (self.path, removing(self.path))):
                with contextlib.suppress(FileNotFoundError):
                    self.lock.unlink()
            os.close(self._fd)


def take(root: Root, name: str) -> Held:
    """The lock of job root `name` (`<id>.<token>`), then the job root itself, empty but for its
    mark (0700), for the runner to lay out. InfraError when `name` is not a job root's name, when
    the root or remote/ is not fit for job roots (`prepare`), when a lock of that name exists
    already (a job root of the same claim, which no runner makes twice), when something is at the
    job root's name already (not a runner's: left as it is), or when it could not be made (what
    this call made is removed, and only that)."""
    if not is_job_name(name):
        raise InfraError(f"{name!r} is not a job root's name (<task id>.<token>)")
    d = prepare(root)
    lock, path = d / f".{name}.lock", d / name
    nonce = secrets.token_hex(16)
    fd = _locked(d, name, nonce.encode())
    try:
        made = _make(d, name, nonce)
    except BaseException as e:
        # Its lock goes with it; a job root made in part and not removable keeps its lock file
        # (free once closed) for recovery (`clear_unmade`).
        if not os.path.lexists(path) or isinstance(e, FileExistsError):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
        os.close(fd)
        if isinstance(e, FileExistsError):
            raise InfraError(
                f"{path} exists without its lock: it is not a job root this runner made, so it is "
                "left as it is and this claim is not run there",
                hint="move it away: the runner's --root keeps remote/ for its job roots",
            ) from None
        if isinstance(e, OSError):
            raise InfraError(f"the job root {path} could not be made: {e.strerror or e}") from None
        raise
    return Held(lock, fd, path, made)


def _locked(d: Path, name: str, nonce: bytes) -> int:
    """A file holding `nonce`, flocked before it has a name, linked at `.<name>.lock` in `d`."""
    dfd = os.open(d, DIR_FLAGS)
    try:
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            return _locked_named(dfd, d, name, nonce)
        linked = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, nonce)
            try:  # linkat(AT_SYMLINK_FOLLOW) through /proc gives the unnamed file its name
                os.link(f"/proc/self/fd/{fd}", f".{name}.lock", dst_dir_fd=dfd)
                linked = True
            except FileExistsError:
                raise _exists(d, name) from None
            except FileNotFoundError:  # no /proc here
                pass
        finally:
            if not linked:
                os.close(fd)
        return fd if linked else _locked_named(dfd, d, name, nonce)
    finally:
        os.close(dfd)


def _locked_named(dfd: int, d: Path, name: str, nonce: bytes) -> int:
    """`_locked` where the file system has no O_TMPFILE: a temp name of this process's (cleared
    only once this pid is gone), retried when it vanished before it was linked."""
    tmp = f".{name}.lock.{os.getpid()}.{threading.get_ident()}.tmp"
    for _ in range(3):
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        linked = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held before it has its name
            os.write(fd, nonce)
            try:
                os.link(tmp, f".{name}.lock", src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                linked = True
            except FileExistsError:
                raise _exists(d, name) from None
            except FileNotFoundError:  # removed before it was linked: made again
                pass
        finally:
            if not linked:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
        if linked:
            return fd
    raise InfraError(f"the job root lock {d / f'.{name}.lock'} could not be made: its temp file vanished")


def _exists(d: Path, name: str) -> InfraError:
    return InfraError(
        f"the job root lock {d / f'.{name}.lock'} exists already: another process made this claim's job root",
        hint=f"`fila recover --root {d.parent}` removes it once nobody holds it",
    )


def _make(d: Path, name: str, nonce: str) -> tuple[int, int]:
    """The job root `name` in `d`, made by its lock's holder: 0700, with the lock's mark inside,
    each step through the directory just made (never through a name someone could swap). Its
    device and inode. FileExistsError when the name is taken: nothing is touched then. A failure
    after the directory was made removes it (only while it is the one made here) and raises."""
    dfd = os.open(d, DIR_FLAGS)
    try:
        os.mkdir(name, 0o700, dir_fd=dfd)
        top = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        fds: list[int] = []
        try:
            fds.append(os.open(name, DIR_FLAGS, dir_fd=dfd))
            if (os.fstat(fds[0]).st_dev, os.fstat(fds[0]).st_ino) != (top.st_dev, top.st_ino):
                raise InfraError(f"{d / name} was replaced while it was being made")
            for part in ("fila", "state"):
                os.mkdir(part, dir_fd=fds[-1])
                fds.append(os.open(part, DIR_FLAGS, dir_fd=fds[-1]))
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            with os.fdopen(os.open(PROOF, flags, 0o600, dir_fd=fds[-1]), "w") as f:
                f.write(nonce)
            return top.st_dev, top.st_ino
        except BaseException:
            with contextlib.suppress(OSError, FilaError):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == (top.st_dev, top.st_ino) and owned(st, stat.S_IFDIR):
                    fsutil.remove_tree(d / name)
            raise
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        os.close(dfd)


def names(root: Root, notes: list[str] | None = None) -> list[str]:
    """The job roots under `root`, by their lock files (a job root may be gone already, or not
    made yet); temp locks of a taker that is gone are removed here. A remote/ group or others may
    reach, a lock that is not a regular file of this user's 0600, a job root or `.removing` without
    a lock file, and what could not be read, is described in `notes` (each by its path) and left
    as it is; other names are not looked at."""
    notes = [] if notes is None else notes
    d = jobs_dir(root)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return []
    except OSError as e:
        notes.append(f"{d}: {e.strerror or e}")
        return []
    if not owned(st, stat.S_IFDIR) or st.st_mode & 0o077:
        notes.append(f"{d} is not a runner's (a link, a file, another user's, or group or others may "
                     "reach it: a runner keeps it 0700): no job root under it is recovered")  # fmt: skip
        return []
    found: set[str] = set()
    try:
        with os.scandir(d) as it:
            every = list(it)
    except OSError as e:
        notes.append(f"{d} could not be listed: {e.strerror or e}")
        return []
    entries = [e for e in every if e.name.startswith(".")]
    for e in entries:
        try:
            temp = _TEMP.fullmatch(e.name)
            if temp is not None and is_job_name(temp["name"]):
                _clear_temp(d, e.name, int(temp["pid"]))
            elif e.name.endswith(".lock") and is_job_name(e.name[1 : -len(".lock")]):
                lst = e.stat(follow_symlinks=False)
                if not owned(lst, stat.S_IFREG) or lst.st_mode & 0o077:
                    why = "a link, another user's, or not 0600 as a runner makes it"
                    notes.append(f"{e.path}: not a runner's lock ({why}): it and its job root are left")
                    continue
                found.add(e.name[1 : -len(".lock")])
        except OSError as err:  # one entry must not stop the others
            notes.append(f"{e.path}: {err.strerror or err}")
    locks = {e.name[1 : -len(".lock")] for e in entries if e.name.endswith(".lock")}
    for e in every:  # what has no lock file is no runner's to remove: said, left as it is
        name = (
            e.name[1 : -len(".removing")]
            if e.name.startswith(".") and e.name.endswith(".removing")
            else e.name
        )
        if not is_job_name(name) or name in locks:
            continue
        what = f"its removal ({e.path}) was" if name != e.name else "it is"
        notes.append(f"{d / name}: {what} left without its lock file (not a runner's, or its lock was "
                     "removed): left as it is; docs/scale-out.md says how to remove one by hand")  # fmt: skip
    return sorted(found)


@contextlib.contextmanager
def free(root: Root, name: str) -> Iterator[str | None]:
    """Job root `name`'s lock for the block when nobody holds it: yields its mark (the caller
    checks it against the job root's with `proven`, may remove the job root, then `forget`s it);
    None when a live process holds it, or when there is no lock file (released meanwhile with its
    job root removed). FilaError when the lock is not a runner's (not a regular file of this
    user's holding a mark): the caller leaves it and its job root as they are."""
    lock = lock_path(root, name)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        fd = -1
    except OSError as e:
        raise FilaError(f"{lock}: not a job root's lock ({e.strerror or e}): left as it is") from None
    if fd < 0:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken = True
        except BlockingIOError:
            taken = False
        if not taken:
            yield None
            return
        data = os.pread(fd, 64, 0) if owned(os.fstat(fd), stat.S_IFREG) else b""
        if not _NONCE.fullmatch(data):
            raise FilaError(f"{lock} does not hold a runner's mark: not a job root's lock, so it and "
                            "its job root are left as they are")  # fmt: skip
        yield data.decode()
    finally:
        os.close(fd)


def proven(path: Path, nonce: str) -> bool:
    """Whether the job root `path` is the one its lock's holder made: a directory of this user's
    that only this user reaches, 0700 as `_make` makes it (no link on the way: each step opened
    without following one) whose mark is `nonce`."""
    fds: list[int] = []
    try:
        fds.append(os.open(path, DIR_FLAGS))
        top = os.fstat(fds[-1])
        if not owned(top, stat.S_IFDIR) or top.st_mode & 0o077:  # a runner makes it 0700; git cannot
            return False
        for part in ("fila", "state"):
            fds.append(os.open(part, DIR_FLAGS, dir_fd=fds[-1]))
        fds.append(os.open(PROOF, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fds[-1]))
        if not owned(os.fstat(fds[-1]), stat.S_IFREG):
            return False
        return hmac.compare_digest(os.pread(fds[-1], 64, 0), nonce.encode())
    except OSError:
        return False
    finally:
        for fd in fds:
            os.close(fd)


def clear_unmade(path: Path, nonce: str) -> bool:
    """A job root whose runner died while making it (`_make`: the directories, then the mark) is
    removed when that is all it holds: empty directories, and a mark of this user's that is a
    proper beginning of its lock's `nonce` (killed between the mark's creation and its write);
    nothing through a link. True when `path` is gone."""
    with contextlib.suppress(OSError):
        top = os.open(path, DIR_FLAGS)
        try:
            with contextlib.suppress(OSError):
                fila = os.open("fila", DIR_FLAGS, dir_fd=top)
                try:
                    with contextlib.suppress(OSError):
                        state = os.open("state", DIR_FLAGS, dir_fd=fila)
                        try:
                            _clear_partial_mark(state, nonce)
                        finally:
                            os.close(state)
                    os.rmdir("state", dir_fd=fila)
                finally:
                    os.close(fila)
            with contextlib.suppress(OSError):
                os.rmdir("fila", dir_fd=top)
        finally:
            os.close(top)
        with contextlib.suppress(OSError):
            os.rmdir(path)
    return not (path.exists() or path.is_symlink())


def _clear_partial_mark(state: int, nonce: str) -> None:
    fd = os.open(PROOF, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=state)
    try:
        st = os.fstat(fd)
        data = os.pread(fd, 64, 0)
    finally:
        os.close(fd)
    if owned(st, stat.S_IFREG) and len(data) < len(nonce) and nonce.encode().startswith(data):
        same = os.stat(PROOF, dir_fd=state, follow_symlinks=False)
        if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(PROOF, dir_fd=state)


def remove(path: Path) -> None:
    """Job root `path` removed by the holder of its lock (its runner, or recovery holding the free
    lock), once no container of it is left: renamed first, in one step, to `removing(path)`, then
    removed there. `rm` walks a tree in directory order and may take the mark before the rest; a
    removal stopped part-way so leaves only the hidden name, never a job root without its mark,
    and its lock file stays (`Held.release`) for the next recovery to finish it
    (`finish_removal`). FilaError when `path` is not a directory of this user's (left as it is),
    or what is left could not be removed."""
    with contextlib.suppress(FileNotFoundError):
        if not owned(os.lstat(path), stat.S_IFDIR):
            raise FilaError(f"{path} is not a directory of this user's: not removed")
        os.rename(path, removing(path))
    finish_removal(path)


def finish_removal(path: Path) -> bool:
    """The rest of job root `path`'s removal (`remove`) stopped part-way, by the holder of its
    lock: `removing(path)` removed when it is a directory of this user's (anything else there is
    left as it is). True when there was one and it is gone."""
    gone = removing(path)
    try:
        if not owned(os.lstat(gone), stat.S_IFDIR):
            return False
    except FileNotFoundError:
        return False
    fsutil.remove_tree(gone)
    return True


def forget(root: Root, name: str) -> None:
    """The lock file of a job root that is gone (called while `free` holds it)."""
    with contextlib.suppress(FileNotFoundError):
        lock_path(root, name).unlink()


def _clear_temp(d: Path, name: str, pid: int) -> None:
    """A temp lock (`_locked_named`) of a process that is gone and that nobody holds: removed.
    Only this user's regular files; a live pid's is its taker's, between its open and its link."""
    p = d / name
    st = os.lstat(p)
    if not owned(st, stat.S_IFREG) or fsutil.pid_alive(pid):
        return
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            same = os.fstat(fd)
            if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino):
                p.unlink()
        except BlockingIOError:
            pass
        finally:
            os.close(fd)

"""Durable file primitives: temp file, fsync, rename, fsync the directory (docs/architecture.md,
"The queue's contract")."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import InfraError, TreeNotRemoved


@contextlib.contextmanager
def file_lock(
    path: Path,
    *,
    wait: bool = True,
    create: bool = True,
    wait_s: float | None = None,
    own: bool = False,
    mode: int = 0o644,
    poll_s: float = 0.1,
) -> Iterator[bool]:
    """fila's one file lock: an exclusive flock on `path` for the block. Yields True when held;
    with `wait=False`, False at once when another open file holds it (the block still runs, and
    the caller decides). flock is per open file, so it also serialises threads of one process;
    the kernel drops it when the process dies, however it dies. O_CLOEXEC: a child (git) never
    inherits it; O_NOFOLLOW: a link planted at the lock's name is refused, not followed.
    `create=False`: FileNotFoundError when there is no lock file (a probe). `wait_s`: wait at
    most that long, then TimeoutError, trying again every `poll_s` (no thread is left blocked
    in the kernel past the wait). `own`: PermissionError unless the lock is a regular file of
    this user's (one another user planted, and holds, would stop whoever needs it). `mode`: a
    new lock file's."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, mode)
    try:
        if own:
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()):
                raise PermissionError(f"{path} is not a regular file of this user's (uid {st.st_uid})")
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if not wait or deadline is not None else 0))
                break
            except BlockingIOError:
                if not wait:
                    yield False
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{path} is held by another process (waited {wait_s:g} s)") from None
                time.sleep(poll_s)
        yield True
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_with(path: Path, data: bytes) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def atomic_write(
    path: Path, data: bytes | str, *, mode: int = 0o644, before_rename: Callable[[], None] | None = None
) -> None:
    """Replace `path` so a reader sees the old or the new content, never a mix, also after a crash.

    os.replace swaps the directory entry itself, so a symlink planted at `path` is replaced, never
    written through. `before_rename` runs with the new content durable in its temp file (a crash
    point of the tests).
    """
    if isinstance(data, str):
        data = data.encode()
    tmp = _temp_with(path, data)
    try:
        os.chmod(tmp, mode)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def create_exclusive(path: Path, data: bytes | str, *, mode: int = 0o644) -> bool:
    """Write `path` durably only if nothing is there yet; False when it exists.

    link() refuses to replace (also on NFS), unlike rename(), which replaces silently.
    """
    if isinstance(data, str):
        data = data.encode()
    tmp = _temp_with(path, data)
    try:
        os.chmod(tmp, mode)
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_dir(path.parent)
    return True


def durable_rename(src: Path, dst: Path) -> None:
    """rename(2) + fsync of both directories. Raises FileNotFoundError when `src` is gone,
    which is how a claim or a lease race is lost."""
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line durably; O_APPEND keeps concurrent writers' lines whole. A short write
    (a full disk) is undone and raised: a torn line would glue itself to the next event. A file
    this call creates has its directory entry fsynced too: a record may already point at it."""
    data = line.encode() + b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        created = False
    except FileNotFoundError:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        created = True
    try:
        start = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write appending to {path}")
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that refuses to replace `dst` (FileExistsError), atomically where the kernel
    and filesystem offer renameat2(RENAME_NOREPLACE); else link() + unlink(). Durable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            fsync_dir(dst.parent)
            if src.parent != dst.parent:
                fsync_dir(src.parent)
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    os.link(src, dst)
    os.unlink(src)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def private_dir(directory: Path, what: str) -> None:
    """`directory` made (0700) when missing, and checked: a real directory of this user's, never a
    link someone planted; its mode put back to 0700. InfraError saying `what` is not kept there."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise InfraError(
            f"{directory} is not a directory of this user's: no {what} is kept there",
            hint="remove it; fila makes it again (0700)",
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(directory, 0o700)


class HeldLock:
    """A lock file this process holds (held_new_lock). Calling it releases it: the file
    removed, then let go (once, whoever calls first). A child process can be made to hold it
    on: `dup()` a descriptor for it (`pass_fds`), then `hand_over()`, after which this process
    neither removes the file nor holds the lock."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd
        self._done = False
        self._mutex = threading.Lock()

    def dup(self) -> int | None:
        """A new descriptor of the held lock (None once released or handed over)."""
        with self._mutex:
            return None if self._done else os.dup(self.fd)

    def hand_over(self) -> None:
        """Another process holds it now (through a `dup()`): this one lets go of its
        descriptor and leaves the file to that process."""
        with self._mutex:
            if not self._done:
                self._done = True
                os.close(self.fd)

    def __call__(self) -> None:
        with self._mutex:
            if self._done:
                return
            self._done = True
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self.fd)


def held_new_lock(path: Path) -> HeldLock:
    """`path` made as a lock file this process holds from its first moment: locked under a temp
    name (`.<name>.tmp` beside it), then renamed, so nobody ever sees it free while its maker
    lives (a sweep that finds it free knows its maker is gone)."""
    return HeldLock(path, held_new_lock_fd(path))


def held_new_lock_fd(path: Path) -> int:
    """held_new_lock's lock as its open descriptor, for a child process to hold on (`pass_fds`):
    the lock lasts while any process keeps the descriptor open."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_held(path: Path) -> bool:
    """Whether a live process holds the lock file `path` (False when there is none)."""
    try:
        with file_lock(path, wait=False, create=False) as got:
            return not got
    except FileNotFoundError:
        return False


def remove_tree(path: Path) -> None:
    """`rm -rf` that survives what an engine can build: trees deeper than Python's recursion
    limit, directories left mode 000. Never follows a symlink (the real tools' default -P).
    What rm cannot remove raises TreeNotRemoved with its stderr."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    subprocess.run(
        ["chmod", "-R", "u+rwx", "--", str(path)],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    res = subprocess.run(
        ["rm", "-rf", "--one-file-system", "--", str(path)],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    if res.returncode != 0:
        err = res.stderr.decode(errors="replace").strip()
        lines = err.splitlines()
        shown = "; ".join(lines[:3]) + (f"; ... ({len(lines) - 3} more)" if len(lines) > 3 else "")
        raise TreeNotRemoved(
            f"could not remove {path}: rm exited {res.returncode}: {shown or 'no message'}",
            hint="remove it by hand (an immutable file: `chattr -i`; a rootless overlay's scratch: "
            "`podman unshare rm -rf DIR`), then `fila retry ID`",
        )


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (this process counts as alive; a process of
    another user too): whose temporary file may be cleared is decided by it."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


# What the host runs out of or fails at (a full disk or quota, an I/O error, a read-only file
# system, no descriptors or memory left), whatever the path: not the task's doing.
HOST_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EMFILE, errno.ENFILE, errno.ENOMEM}
)


def host_fault(e: BaseException) -> bool:
    """Whether `e` is the host's failure (HOST_ERRNOS, or no memory left), not a task's."""
    return isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in HOST_ERRNOS)

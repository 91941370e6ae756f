"""Walk and read a tree that an untrusted party wrote, never following a symlink.

The engine controls every name, type, mode and size under `work/` (threat model, "The host reading
what the engine left"). So: `lstat` semantics only; files are opened with O_NOFOLLOW|O_NONBLOCK
and the *fd* is fstat'ed (a FIFO must not block us, a device must not be read, a symlink swapped
in after the walk must not be followed); sizes are checked before reading (a sparse 1 TB file has
a 1 TB st_size and costs nothing to make); and paths below a root are resolved one component at
a time from directory fds opened with O_NOFOLLOW, so no component can be a symlink and no path is
too long for the kernel however deep the tree is.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..core.errors import FilaError, LimitExceeded
from ..core.text import escape_name as escape_name
from ..core.text import inert as inert
from ..core.text import invisible as invisible

Kind = Literal["file", "symlink", "dir", "other"]

# How fila opens a directory it walks: never through a symlink, never inherited by a child.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Entry:
    rel: str  # '/'-separated, from os.fsdecode: may hold surrogate escapes (invalid UTF-8)
    kind: Kind  # "other" is a fifo, socket or device: never opened
    mode: int  # st_mode, from lstat
    size: int
    nlink: int


def kind_of(mode: int) -> Kind:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"


def open_dir(root: Path) -> int:
    """An fd for the directory `root`; refuse a symlink or anything that is not a directory."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise FilaError("directory not found", path=root) from None
    if stat.S_ISLNK(st.st_mode):
        raise FilaError(
            "refusing a directory that is a symlink",
            path=root,
            hint="the engine replaced it; the job's result cannot be trusted",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise FilaError("not a directory", path=root, hint="the engine replaced it")
    try:
        return os.open(root, DIR_FLAGS)  # O_NOFOLLOW: still no symlink after the lstat
    except OSError as err:
        raise FilaError(f"cannot open directory: {err.strerror}", path=root) from None


def _checked(fd: int, where: str, max_bytes: int) -> int:
    """Keep `fd` only if it is a regular file of at most max_bytes; return its size."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FilaError("not a regular file (fifo, socket, device or directory)", path=escape_name(where))
        if st.st_size > max_bytes:
            raise LimitExceeded(
                f"file of {st.st_size} bytes is over the limit of {max_bytes} bytes",
                path=escape_name(where),
            )
    except BaseException:
        os.close(fd)
        raise
    return st.st_size


def _open_error(err: OSError, where: str) -> FilaError:
    if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
        return FilaError("refusing to open a symlink", path=escape_name(where))
    return FilaError(f"cannot open: {err.strerror}", path=escape_name(where))


def read_exact(fd: int, size: int) -> bytes:
    """Exactly `size` bytes from `fd` (a regular file); a file that shrank is an error."""
    data = os.read(fd, size)
    if len(data) == size:
        return data
    parts, got = [data], len(data)
    while got < size:
        chunk = os.read(fd, size - got)
        if not chunk:
            raise FilaError("file shrank while it was being read")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_file(path: Path, *, max_bytes: int) -> bytes:
    """The bytes of the regular file `path` (not a symlink, FIFO or device), at most max_bytes.

    The size is checked on the open fd before any byte is read.
    """
    try:
        fd = os.open(path, _FILE_FLAGS)
    except OSError as err:
        raise _open_error(err, str(path)) from None
    size = _checked(fd, str(path), max_bytes)
    try:
        return read_exact(fd, size)
    finally:
        os.close(fd)


class Tree:
    """A directory opened once; what lies below it is reached without following any symlink.

    Files come in sorted order from `walk`, so the fd of the last parent directory is cached:
    reading a whole tree costs about one extra open per directory.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd = open_dir(root)
        self._parent: tuple[str, int] | None = None

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._drop_parent()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _drop_parent(self) -> None:
        if self._parent is not None:
            os.close(self._parent[1])
            self._parent = None

    def _dir(self, parent: str) -> int:
        if not parent:
            return self._fd
        if self._parent is not None and self._parent[0] == parent:
            return self._parent[1]
        self._drop_parent()
        fd = self._fd
        try:
            for part in parent.split("/"):
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
                if fd != self._fd:
                    os.close(fd)
                fd = nfd
        except OSError as err:
            if fd != self._fd:
                os.close(fd)
            if err.errno in (errno.ENOTDIR, errno.ELOOP):
                raise FilaError(
                    "refusing a path through a symlink or a file", path=escape_name(parent)
                ) from None
            raise _open_error(err, parent) from None
        self._parent = (parent, fd)
        return fd

    def open(self, rel: str, *, max_bytes: int) -> tuple[int, int]:
        """(fd, size) of the regular file `rel`; the caller closes fd."""
        parent, _, name = rel.rpartition("/")
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self._dir(parent))
        except OSError as err:
            raise _open_error(err, rel) from None
        return fd, _checked(fd, rel, max_bytes)

    def readlink(self, rel: str) -> bytes:
        """The target of the symlink `rel`, as bytes: data, never followed."""
        parent, _, name = rel.rpartition("/")
        try:
            return os.readlink(os.fsencode(name), dir_fd=self._dir(parent))
        except OSError as err:
            raise FilaError(f"cannot read link: {err.strerror}", path=escape_name(rel)) from None


def walk(
    root: Path,
    *,
    skip: Callable[[str, bool], bool] | None = None,
    max_files: int,
    max_bytes: int,
    max_depth: int = 64,
    max_path_bytes: int = 4096,
) -> Iterator[Entry]:
    """Every entry below `root`, depth first, names sorted by their bytes, symlinks not followed.

    `skip(rel, is_dir)` returning True prunes an entry (and, for a directory, what it holds);
    pruned entries count toward no limit, but one directory listing more than max_files names is
    refused before it is sorted. max_files counts entries of every kind, max_bytes the sizes of
    regular files (st_size, so a sparse file counts at its full size).
    Raises FilaError when `root` is a symlink or not a directory, LimitExceeded past a limit.
    """
    rfd = open_dir(root)
    try:
        for found in walk_fd(
            rfd,
            label=str(root),
            skip=skip,
            max_files=max_files,
            max_bytes=max_bytes,
            max_depth=max_depth,
            max_path_bytes=max_path_bytes,
        ):
            yield found.entry
    finally:
        os.close(rfd)


@dataclass(frozen=True)
class Found:
    """An entry of `walk_fd` with what it takes to open it without a path: the fd of the
    directory holding it (valid until the walk moves on), its raw name there, and its lstat.
    Whoever reads it opens `name` relative to `dir_fd` and compares (st_dev, st_ino) with
    `st`: a name swapped after the listing is then refused, never followed."""

    entry: Entry
    dir_fd: int
    name: bytes
    st: os.stat_result


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_beneath(base_fd: int, rel: str) -> int:
    """A new fd for the directory `rel` below the directory `base_fd`, one component at a time
    with O_NOFOLLOW: no component can be a symlink, whatever is swapped meanwhile."""
    fd = os.dup(base_fd)
    try:
        for part in [p for p in rel.split("/") if p not in ("", ".")]:
            if part == "..":
                raise FilaError("refusing '..' in a path", path=escape_name(rel))
            nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.ENOTDIR, errno.ELOOP):
            raise FilaError("refusing a path through a symlink or a file", path=escape_name(rel)) from None
        raise _open_error(err, rel) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def walk_fd(
    rfd: int,
    *,
    label: str,
    skip: Callable[[str, bool], bool] | None = None,
    max_files: int,
    max_bytes: int,
    max_depth: int = 64,
    max_path_bytes: int = 4096,
) -> Iterator[Found]:
    """`walk` below the open directory `rfd` (the caller's; not closed), yielding each entry with
    its directory fd: a copy that opens files through these fds cannot be sent outside the tree
    by a directory swapped for a symlink above them. A subdirectory whose inode changed between
    its listing and its open is refused."""
    files = 0
    total = 0
    # Names listed but not yet visited, across every directory open on the way down: they bound
    # the next listing too, or nested wide directories would hold millions of names at once.
    pending = 0

    def visit(dfd: int, prefix: str, depth: int) -> Iterator[Found]:
        nonlocal files, total, pending
        names = entry_names(dfd, prefix, max(0, max_files - files - pending), max_files)
        pending += len(names)
        for raw, name in names:
            pending -= 1
            rel = prefix + name
            try:
                st = os.stat(raw, dir_fd=dfd, follow_symlinks=False)
            except OSError as err:
                raise FilaError(f"cannot stat: {err.strerror}", path=escape_name(rel)) from None
            kind = kind_of(st.st_mode)
            if skip is not None and skip(rel, kind == "dir"):
                continue
            if depth > max_depth:
                raise LimitExceeded(f"tree deeper than max_depth={max_depth}", path=escape_name(rel))
            if len(os.fsencode(rel)) > max_path_bytes:
                raise LimitExceeded(
                    f"path longer than max_path_bytes={max_path_bytes}",
                    path=escape_name(rel[:200]) + "...",
                )
            files += 1
            if files > max_files:
                raise LimitExceeded(f"more than max_files={max_files} entries", path=label)
            if kind == "file":
                total += st.st_size
                if total > max_bytes:
                    raise LimitExceeded(f"files total more than max_bytes={max_bytes}", path=escape_name(rel))
            yield Found(Entry(rel, kind, st.st_mode, st.st_size, st.st_nlink), dfd, raw, st)
            if kind == "dir":
                try:
                    cfd = os.open(raw, DIR_FLAGS, dir_fd=dfd)
                except OSError as err:
                    raise _open_error(err, rel) from None
                try:
                    if not same_file(os.fstat(cfd), st):
                        raise FilaError("directory replaced while it was being read", path=escape_name(rel))
                    yield from visit(cfd, rel + "/", depth + 1)
                finally:
                    os.close(cfd)

    yield from visit(rfd, "", 1)


def entry_names(dfd: int, prefix: str, limit: int, max_files: int) -> list[tuple[bytes, str]]:
    """The names in one directory, sorted by bytes; refuse a listing longer than `limit` before
    holding it all (millions of small files must not exhaust memory)."""
    out: list[tuple[bytes, str]] = []
    try:
        with os.scandir(dfd) as it:
            for e in it:
                out.append((os.fsencode(e.name), e.name))
                if len(out) > limit:
                    raise LimitExceeded(
                        f"more than max_files={max_files} entries in one directory and the "
                        f"ones listed above it ({limit} were left)",
                        path=escape_name(prefix) or ".",
                    )
    except OSError as err:
        raise FilaError(f"cannot list: {err.strerror}", path=escape_name(prefix) or ".") from None
    out.sort()
    return out

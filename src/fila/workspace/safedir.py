"""A directory that fila reads and writes without ever following a symlink in it.

`fila apply` writes into the person's project, and reads work/ (the engine's), input/ and its own
staging copies. Every path below the root is reached one component at a time from directory fds
opened with O_NOFOLLOW, so a symlink anywhere on the way (planted before or during the apply)
makes the operation fail instead of leading elsewhere. Files are written to a temporary name in
their directory and renamed over the old entry: a symlink or hard link at the destination is
replaced, never written through, and a reader sees the old or the new file, never a mix.
Only regular files (0644 or 0755), symlinks and directories are ever created.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.errors import FilaError, LimitExceeded
from .fswalk import escape_name, open_dir

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1 << 20


class ThroughLink(FilaError):
    """A component on the way to a path is a symlink (or a file): fila does not go through it."""

    is_link = True


@dataclass(frozen=True)
class State:
    """What is at a path: the comparison unit of the moved-base check and of the landing."""

    kind: str  # absent | file | symlink | dir | other
    mode: int = 0  # 0o644 or 0o755 for a file (the owner's exec bit decides, as in git)
    sha256: str = ""  # of a file's bytes or of a symlink's target

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> State:
        return cls(kind=str(d["kind"]), mode=int(d["mode"]), sha256=str(d["sha256"]))

    def show(self) -> str:
        if self.kind == "file":
            return f"file {self.mode:o} {self.sha256[:12]}"
        return self.kind


ABSENT = State("absent")


def file_mode(st_mode: int) -> int:
    return 0o755 if st_mode & stat.S_IXUSR else 0o644


class SafeDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd = open_dir(root)

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @contextlib.contextmanager
    def parent(self, rel: str, *, made: list[str] | None = None) -> Iterator[tuple[int, str]]:
        """(fd of rel's directory, rel's last name). With `made`, missing directories are created
        (0755) and appended to it; without, a missing one raises FileNotFoundError."""
        parts = rel.split("/")
        fd = self.fd
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    nfd = os.open(part, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if made is None:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made.append("/".join(parts[: i + 1]))
                    nfd = os.open(part, _DIR, dir_fd=fd)
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR):
                        where = "/".join(parts[: i + 1])
                        st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                        e = ThroughLink(
                            f"{escape_name(where)} is a symlink or a file, not a directory",
                            path=self.root / escape_name(rel),
                        )
                        e.is_link = stat.S_ISLNK(st.st_mode)
                        raise e from None
                    raise
                if fd != self.fd:
                    os.close(fd)
                fd = nfd
            yield fd, parts[-1]
        finally:
            if fd != self.fd:
                os.close(fd)

    def lstat(self, rel: str) -> os.stat_result | None:
        """None when nothing is reachable there (missing, or below a symlink or a file)."""
        try:
            with self.parent(rel) as (dfd, name):
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, ThroughLink):
            return None

    def state(self, rel: str, *, max_bytes: int) -> State:
        """What is at `rel`; a path through a symlink is `other`. Reads and hashes a file."""
        try:
            with self.parent(rel) as (dfd, name):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    target = os.readlink(os.fsencode(name), dir_fd=dfd)
                    return State("symlink", 0, hashlib.sha256(target).hexdigest())
                if stat.S_ISDIR(st.st_mode):
                    return State("dir")
                if not stat.S_ISREG(st.st_mode):
                    return State("other")
                h = hashlib.sha256()
                fd = self._open_file(dfd, name, rel, max_bytes)
                try:
                    while chunk := os.read(fd, _CHUNK):
                        h.update(chunk)
                finally:
                    os.close(fd)
                return State("file", file_mode(st.st_mode), h.hexdigest())
        except FileNotFoundError:
            return ABSENT
        except ThroughLink as e:
            # Below a file nothing can be; below a symlink is somewhere else.
            return State("other") if e.is_link else ABSENT

    def _open_file(self, dfd: int, name: str, rel: str, max_bytes: int) -> int:
        fd = os.open(name, _READ, dir_fd=dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            os.close(fd)
            if st.st_size > max_bytes:
                raise LimitExceeded(f"file larger than {max_bytes} bytes", path=escape_name(rel))
            raise FilaError("not a regular file", path=escape_name(rel))
        return fd

    def read(self, rel: str, *, max_bytes: int) -> bytes:
        with self.parent(rel) as (dfd, name):
            fd = self._open_file(dfd, name, rel, max_bytes)
            try:
                parts = []
                while chunk := os.read(fd, _CHUNK):
                    parts.append(chunk)
                return b"".join(parts)
            finally:
                os.close(fd)

    def readlink(self, rel: str) -> bytes:
        with self.parent(rel) as (dfd, name):
            return os.readlink(os.fsencode(name), dir_fd=dfd)

    def copy_to(self, rel: str, dst: SafeDir, dst_rel: str | None = None, *, max_bytes: int,
                made: list[str] | None = None, mode: int | None = None) -> State:  # fmt: skip
        """Copy the file or symlink `rel` to `dst`; return the State of what was copied (hashed
        while copying, so it is exactly what the copy holds). Anything else is not copied.
        A file is written 0644 or 0755 after the source's owner exec bit, or with the permission
        bits `mode` (only to put back a person's own file exactly as it was)."""
        dst_rel = dst_rel or rel
        try:
            with self.parent(rel) as (dfd, name):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    target = os.readlink(os.fsencode(name), dir_fd=dfd)
                    dst.put_link(dst_rel, target, made=made)
                    return State("symlink", 0, hashlib.sha256(target).hexdigest())
                if not stat.S_ISREG(st.st_mode):
                    return State("dir") if stat.S_ISDIR(st.st_mode) else State("other")
                fd = self._open_file(dfd, name, rel, max_bytes)
                try:
                    perm = file_mode(os.fstat(fd).st_mode) if mode is None else mode & 0o777
                    sha = dst.put_file(dst_rel, _chunks(fd), perm, made=made)
                finally:
                    os.close(fd)
                return State("file", file_mode(perm), sha)
        except FileNotFoundError:
            return ABSENT
        except ThroughLink as e:
            return State("other") if e.is_link else ABSENT

    def put_file(self, rel: str, chunks: Iterator[bytes], mode: int, *,
                 made: list[str] | None = None) -> str:  # fmt: skip
        """Write a regular file of exactly `mode` by temp file + rename; returns the sha256 of
        what was written. Never setuid, setgid or sticky: only the 0777 bits are accepted."""
        if mode & ~0o777:
            raise ValueError(f"refusing file mode {mode:o}")
        h = hashlib.sha256()
        with self.parent(rel, made=made if made is not None else []) as (dfd, name):
            tmp = _tmp_name()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=dfd)  # fmt: skip
            try:
                try:
                    for chunk in chunks:
                        h.update(chunk)
                        os.write(fd, chunk)
                    os.fchmod(fd, mode)  # explicit: neither the umask nor the source decides
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            os.fsync(dfd)
        return h.hexdigest()

    def put_link(self, rel: str, target: bytes, *, made: list[str] | None = None) -> None:
        with self.parent(rel, made=made if made is not None else []) as (dfd, name):
            tmp = _tmp_name()
            os.symlink(target, tmp, dir_fd=dfd)
            try:
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            os.fsync(dfd)

    def unlink(self, rel: str) -> None:
        with self.parent(rel) as (dfd, name):
            os.unlink(name, dir_fd=dfd)
            os.fsync(dfd)

    def rmdir(self, rel: str) -> bool:
        """Remove an empty directory; False when it is not empty (or not there)."""
        try:
            with self.parent(rel) as (dfd, name):
                os.rmdir(name, dir_fd=dfd)
                os.fsync(dfd)
                return True
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                return False
            raise

    def mkdir(self, rel: str) -> None:
        with self.parent(rel, made=[]) as (dfd, name), contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=dfd)


def _tmp_name() -> str:
    # Short: the final name may be near NAME_MAX, and the temporary one must still fit.
    return f".fila-{secrets.token_hex(6)}.tmp"


def _chunks(fd: int) -> Iterator[bytes]:
    while chunk := os.read(fd, _CHUNK):
        yield chunk

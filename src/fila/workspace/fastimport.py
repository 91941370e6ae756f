"""The two sides of DIFF.patch in git: the files that differ, streamed into one `git fast-import`
per side (in parallel: hashing is what costs most) in a throwaway bare repository, each committed
to its ref for `git diff-tree` to compare; work/'s side masked of known credentials on the way
(workspace/diff.py decides what is fed; docs/architecture.md, threat model)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ..core.models import CredentialsFound
from . import fswalk
from .fswalk import Entry, Tree, escape_name
from .hardgit import Git
from .secretscan import Scanner

CHUNK = 1 << 20
# Pinned whatever the defaults: nothing that runs a program or changes the output, then what keeps
# the throwaway repository fast and small.
# On top of hardgit's (hooks, fsmonitor, attributes): the diff's own settings.
_GIT_CONFIG = (
    "-c", "diff.external=",
    "-c", "core.quotePath=true",
    "-c", "core.bigFileThreshold=512m",  # above it git treats a file as binary: keep it fixed
    "-c", "pack.compression=0",  # a throwaway pack: spend no CPU on compressing it
    "-c", "fastimport.unpackLimit=0",  # and keep a small one packed, not exploded into files
    "-c", "core.packedGitWindowSize=1m",  # read the pack through small windows: the RSS of
    "-c", "core.packedGitLimit=32m",  # diff-tree stays near the largest changed pair
)  # fmt: skip


class Found:
    """The known credentials met while the patch is built: counted per label, and for each work/
    file that held one, the sha256 of its masked bytes (what applying the patch writes)."""

    def __init__(self, scanner: Scanner | None) -> None:
        self.scanner = scanner if scanner else None
        self.counts: Counter[str] = Counter()
        self.files: dict[str, str] = {}

    def mask(self, rel: str, data: bytes) -> bytes:
        if self.scanner is None:
            return data
        counts: Counter[str] = Counter()
        out = self.scanner.mask(data, counts)
        if counts:
            self.counts.update(counts)
            self.files[escape_name(rel)] = hashlib.sha256(out).hexdigest()
        return out

    def wrap(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """The patch text, with any needle left in it (a name, a line of input/) replaced."""
        if self.scanner is None:
            return chunks
        masker = self.scanner.stream()
        masker.counts = self.counts
        return masker.wrap(chunks)

    def result(self) -> CredentialsFound | None:
        return CredentialsFound(counts=dict(self.counts), files=self.files) if self.counts else None


class Importers:
    """The repository and one fast-import per side, started at the first difference: an
    unchanged work/ (a no-op task) runs no git process at all."""

    def __init__(self, tmp: Path, found: Found) -> None:
        self.tmp, self.found = tmp, found
        self._git: Git | None = None
        self.pair: tuple[Importer, Importer] | None = None

    @property
    def git(self) -> Git:
        if self._git is None:
            self._git = Git(self.tmp, purpose="diffs", config=_GIT_CONFIG)
        return self._git

    def __getitem__(self, side: int) -> Importer:
        if self.pair is None:
            # One fast-import per side, run in parallel: hashing (SHA-1DC) is what costs most.
            self.pair = (
                Importer(self.git, b"refs/fila/input"),
                Importer(self.git, b"refs/fila/work", self.found),  # what the engine left: scanned
            )
        return self.pair[side]

    def started(self) -> tuple[Importer, ...]:
        return self.pair or ()


def git_mode(e: Entry) -> bytes:
    if e.kind == "symlink":
        return b"120000"
    return b"100755" if e.mode & stat.S_IXUSR else b"100644"


class Importer:
    """A `git fast-import` process fed one side's blobs as they are found, then its commit."""

    def __init__(self, git: Git, ref: bytes, found: Found | None = None) -> None:
        self.git, self.ref, self.found = git, ref, found
        # --depth=0: no delta search between consecutive blobs, which only costs CPU here.
        # --big-file-threshold: a blob over 1 MiB is streamed to the pack, not held in memory.
        self.proc = git.popen(
            ["fast-import", "--quiet", "--done", "--depth=0", "--big-file-threshold=1m"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        assert self.proc.stdin is not None
        self.out: IO[bytes] = self.proc.stdin
        with contextlib.suppress(OSError):  # a larger pipe lets both importers keep busy
            fcntl.fcntl(self.out.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
        self.marks = 0
        self.tree: list[bytes] = []
        # Packs are named after their content and both importers write into one repository:
        # a blob naming the side keeps two identical packs (a mode-only change) from colliding.
        self._write(b"blob\ndata %d\n%s\n" % (len(ref), ref))

    def _blob(self, mode: bytes, rel: str, size: int) -> None:
        self.marks += 1
        self._write(b"blob\nmark :%d\ndata %d\n" % (self.marks, size))
        self.tree.append(b"M %s :%d %s\n" % (mode, self.marks, _quote(os.fsencode(rel))))

    def _write(self, data: bytes) -> None:
        try:
            self.out.write(data)
        except BrokenPipeError:
            self.git.check(self.proc, "git fast-import")
            raise

    def add_data(self, mode: bytes, rel: str, data: bytes) -> None:
        if self.found is not None:
            data = self.found.mask(rel, data)
        self._blob(mode, rel, len(data))
        self._write(data + b"\n")

    def add_fd(self, mode: bytes, rel: str, fd: int, size: int, data: bytes | None) -> None:
        """A file's blob: `data` when already read, else streamed from fd in chunks."""
        if data is not None:
            self.add_data(mode, rel, data)
            return
        scanner = self.found.scanner if self.found is not None else None
        if scanner is not None and scanner.find_in_fd(fd, size):
            # At most max_diff_bytes (a larger changed file is refused before): masked in memory.
            os.lseek(fd, 0, os.SEEK_SET)
            self.add_data(mode, rel, fswalk.read_exact(fd, size))
            return
        os.lseek(fd, 0, os.SEEK_SET)
        self._blob(mode, rel, size)
        left = size
        while left:
            chunk = fswalk.read_exact(fd, min(CHUNK, left))
            self._write(chunk)
            left -= len(chunk)
        self._write(b"\n")

    def add_entry(self, tree: Tree, e: Entry, max_bytes: int) -> None:
        if e.kind == "symlink":
            self.add_data(b"120000", e.rel, tree.readlink(e.rel))
            return
        fd, size = tree.open(e.rel, max_bytes=max_bytes)
        try:
            self.add_fd(git_mode(e), e.rel, fd, size, None)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Commit the tree to `ref` and end the stream (`done`: a cut stream is an error)."""
        self._write(b"commit %s\ncommitter fila <fila> 0 +0000\ndata 0\n" % self.ref)
        self._write(b"".join(self.tree) + b"\ndone\n")
        with contextlib.suppress(BrokenPipeError):
            self.out.close()

    def wait(self) -> None:
        self.git.check(self.proc, "git fast-import")

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.out.close()  # without `done`, fast-import exits with an error and keeps no ref
        self.proc.kill()
        self.proc.wait()


def _quote(path: bytes) -> bytes:
    """A path as fast-import reads it: C-style quoted, so any byte (newline, quote) is safe."""
    out = bytearray(b'"')
    for byte in path:
        if byte in b'"\\':
            out += b"\\" + bytes([byte])
        elif byte < 0x20 or byte >= 0x7F:
            out += b"\\%03o" % byte
        else:
            out.append(byte)
    return bytes(out + b'"')

"""DIFF.patch: what the engine changed in work/, as a git patch a person reviews, then applies.

The host computes it after the container is gone. work/ is hostile (threat model, "The host reading
what the engine left"), so git never opens a path in it: fswalk reads input/ and work/ (no symlink
followed, no FIFO opened, sizes capped before reading) and only the files that differ are streamed
into `git fast-import` in a throwaway bare repository under `scratch`; `git diff-tree` then
compares the two trees it built. That repository has no work tree and no index, and git runs with
no system, global or repository configuration but ours, so a planted `.gitattributes`, hook or
config changes nothing.

This module decides what is compared and what the patch holds; feeding the two sides to git is
`fastimport`'s (docs/architecture.md, layers).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import FilaError, LimitExceeded
from ..core.models import CredentialsFound, DiffStat, Policy
from ..queue.policy import denied_by
from . import fswalk
from .fastimport import CHUNK, Found, Importers, git_mode
from .fswalk import Entry, Tree, escape_name
from .overlay import Layers
from .secretscan import Scanner

_MAX_WARNINGS = 100
_SPECIAL_NAMES = {b".gitattributes", b".gitmodules"}  # change what git does in the project
# Code points HFS+ ignores in names: ".g\u200cit" is ".git" there, and `git apply` refuses it.
_IGNORABLE = {chr(c) for lo, hi in ((0x200C, 0x2010), (0x202A, 0x202F), (0x206A, 0x2070))
              for c in range(lo, hi)} | {"\ufeff"}  # fmt: skip


@dataclass
class DiffResult:
    patch_path: Path
    sha256: str  # of the patch bytes, as written
    bytes: int
    stat: DiffStat  # paths are escaped with fswalk.escape_name
    warnings: list[str] = field(default_factory=list)
    credentials: CredentialsFound | None = None  # known credentials replaced by their marker


def compute_diff(
    job_dir: Path,
    *,
    policy: Policy,
    scratch: Path,
    out_name: str = "DIFF.patch",
    skip: Callable[[str, bool], bool] | None = None,
    layers: Layers | None = None,
    credentials: Scanner | None = None,
) -> DiffResult:
    """Write `job_dir/out_name`, the patch from `job_dir/input` to `job_dir/work`.

    With `layers` (the `overlay` strategy), input/ is the snapshot `layers.lower` and work/ that
    snapshot under the upper layer `layers.upper`; only the upper layer and what it hides of the
    snapshot are read, and the patch is byte for byte the one the copy strategy gives.

    The recipe, which `fila apply` relies on (change one side, change the other):
    - `git apply PATCH` (default -p1) run in the project root: every path is relative to input/
      and work/, which are copies of the project root's files, and prefixed a/ and b/.
    - git's own format, `git diff-tree -p --binary --full-index --no-renames`: binary files as
      base85 with full blob ids (apply can check the preimage), no rename or copy detection (each
      section names the one path it touches), names git-quoted (newlines, escapes, non-UTF-8).
    - regular files as mode 100644 or 100755 (the owner's exec bit, as git does: setuid and other
      bits are dropped), symlinks as mode 120000 with the link text as content.
    - never in the patch, each with a warning: FIFOs, sockets, devices, names git apply refuses
      (a `.git` component in any NTFS/HFS+ spelling, a `.gitmodules` symlink), paths matching the
      policy's deny rules or `skip(rel, is_dir)` (pass jobdir's exclusions, e.g. the queue's
      `fila/` and `sandbox/`, so a patch can never write into them). Empty directories cannot be
      represented (git tracks files).
    - with `credentials`, no known credential (secretscan: the value or an encoding of it): each
      is replaced by its marker in work/'s side, file contents and link targets, binary files
      included (git's binary hunks are compressed, so the patch text alone would hide it), then
      anywhere else in the patch text (a name, a line input/ already held). `credentials` on
      the result counts them, with the sha256 of each file as the patch writes it.
    An unchanged work/ gives an empty patch (0 bytes). The patch replaces whatever the engine
    planted at `out_name` (temporary file, fsync, rename: a symlink is never written through).
    Raises FilaError when work/ or input/ is a symlink or not a directory, LimitExceeded past
    max_work_files, max_work_bytes or max_diff_bytes (then no patch is written).
    """
    if not out_name or "/" in out_name or out_name in {".", ".."}:
        raise FilaError(f"bad patch file name {out_name!r}")
    notes = _Notes()
    made_scratch = not scratch.exists()
    scratch.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="fila-diff-", dir=scratch))
    patch: Path | None = None
    try:
        found = Found(credentials)
        imps = Importers(tmp, found)
        sides = (job_dir / "input", job_dir / "work") if layers is None else (layers.lower, layers.upper)
        with Tree(sides[0]) as before, Tree(sides[1]) as after:
            changed = _import_changes(imps, before, after, policy, skip, notes, layers)
        if not changed:
            patch, digest, size = _write_temp(job_dir, out_name, iter(()), policy.max_diff_bytes)
            stat_ = DiffStat()
        else:
            git = imps.git
            # Two diff-tree runs over the same two trees, side by side: the stat and the patch.
            numstat = git.popen(["diff-tree", "-r", "--numstat", "-z", "--no-renames",
                                 "refs/fila/input", "refs/fila/work"])  # fmt: skip
            args = ["diff-tree", "-r", "-p", "--binary", "--full-index", "--no-renames",
                    "--src-prefix=a/", "--dst-prefix=b/", "--no-color", "--no-ext-diff",
                    "--no-textconv", "refs/fila/input", "refs/fila/work"]  # fmt: skip
            try:
                with contextlib.closing(git.stream(args)) as chunks:
                    patch, digest, size = _write_temp(job_dir, out_name, found.wrap(chunks),
                                                      policy.max_diff_bytes)  # fmt: skip
                stat_ = _numstat(git.collect(numstat, "git diff-tree --numstat"), notes)
            finally:
                if numstat.poll() is None:
                    numstat.kill()
                    numstat.wait()
        dest = _publish(patch, job_dir / out_name)
    except BaseException:
        if patch is not None:
            with contextlib.suppress(OSError):
                os.unlink(patch)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_scratch:
            with contextlib.suppress(OSError):
                scratch.rmdir()
    return DiffResult(dest, digest, size, stat_, notes.out(), found.result())


class _Notes:
    """Warnings for the review record, capped: an engine can leave a million FIFOs."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.more = 0

    def add(self, msg: str) -> None:
        if len(self.items) < _MAX_WARNINGS:
            self.items.append(msg)
        else:
            self.more += 1

    def out(self) -> list[str]:
        return self.items + ([f"... and {self.more} more warnings"] if self.more else [])


def _import_changes(
    imps: Importers,
    before: Tree,
    after: Tree,
    policy: Policy,
    skip: Callable[[str, bool], bool] | None,
    notes: _Notes,
    layers: Layers | None = None,
) -> bool:
    """Feed fast-import the files that differ; True when anything does.

    Unchanged files are left out of both trees: they cannot appear in the diff, and leaving them
    out spares hashing and compressing the whole project. Each file is read once, except a large
    (> 1 MiB) one that turns out to differ, which is read again to stream it.
    """
    changed = False
    try:
        if layers is None:
            pairs = _pairs(_entries(before, policy, skip, None), _entries(after, policy, skip, notes))
        else:
            # The upper layer first (it says what the snapshot lost), held in memory: its size is
            # what the engine changed. Then the snapshot's hidden entries, in the same order.
            lay, mf, mb = layers, policy.max_work_files, policy.max_work_bytes

            def upper_walk(prune: Callable[[str, bool], bool]) -> Iterator[Entry]:
                return lay.upper_walk(prune, max_files=mf, max_bytes=mb)

            upper = list(_entries(after, policy, skip, notes, upper_walk))
            lower = _entries(before, policy, skip, None, layers.lower_walk)
            pairs = _pairs(lower, iter(upper))
        for a, b in pairs:
            changed |= _one(imps, before, after, a, b, policy.max_work_bytes, notes, policy.max_diff_bytes)
        if layers is not None:
            layers.check_totals(max_files=policy.max_work_files, max_bytes=policy.max_work_bytes)
    except BaseException:
        for imp in imps.started():
            imp.abort()
        raise
    for imp in imps.started():
        imp.close()
    for imp in imps.started():
        imp.wait()
    return changed


def _means(name: str, word: str, short: str) -> bool:
    """Does `name` mean `.word` to NTFS or HFS+ (case, trailing dots and spaces, a ':' stream,
    ignorable code points, an 8.3 short name matching `short`)? git apply's verify_path refuses
    such names, and one refused path would make the whole patch fail to apply."""
    n = "".join(c for c in name if c not in _IGNORABLE).lower()
    n = re.split(r"[:\\]", n, maxsplit=1)[0].rstrip(". ")
    return n == "." + word or re.fullmatch(short, n) is not None


def _entries(
    tree: Tree,
    policy: Policy,
    skip: Callable[[str, bool], bool] | None,
    notes: _Notes | None,
    walker: Callable[[Callable[[str, bool], bool]], Iterator[Entry]] | None = None,
) -> Iterator[Entry]:
    """Files and symlinks of one side; `notes` is None for input/, which fila itself wrote.
    `walker(prune)` replaces the walk of the whole tree (an overlay's layers)."""
    warn = notes.add if notes is not None else (lambda msg: None)

    def prune(rel: str, is_dir: bool) -> bool:
        if _means(rel.rpartition("/")[2], "git", "git~1"):
            warn(f"not in the diff: {escape_name(rel)} (a .git path; git apply refuses it)")
            return True
        rule = denied_by(rel, is_dir, policy.deny)
        if rule is not None:
            warn(f"not in the diff: {escape_name(rel)} (matches the policy's deny rule {rule!r})")
            return True
        if skip is not None and skip(rel, is_dir):
            warn(f"not in the diff: {escape_name(rel)} (excluded from jobs)")
            return True
        return False

    found = walker(prune) if walker is not None else fswalk.walk(
        tree.root, skip=prune, max_files=policy.max_work_files, max_bytes=policy.max_work_bytes)  # fmt: skip
    for e in found:
        if e.kind == "other":
            warn(f"not in the diff: {escape_name(e.rel)} ({_special_kind(e.mode)}, not a file)")
        elif e.kind == "file":
            if e.nlink > 1:
                warn(f"hard link: {escape_name(e.rel)} has {e.nlink} links; the patch holds a copy")
            if e.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
                warn(f"setuid/setgid/sticky bit of {escape_name(e.rel)} dropped (only 0644/0755)")
            yield e
        elif e.kind == "symlink":
            if not _means(e.rel.rpartition("/")[2], "gitmodules", "gitmod~[1-4]|gi7eba~[1-9]"):
                yield e
            else:
                warn(f"not in the diff: {escape_name(e.rel)} (a .gitmodules symlink: git refuses it)")


def _special_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file"


def _key(e: Entry) -> tuple[bytes, ...]:
    # walk's order: depth first, names sorted by bytes; comparing component tuples matches it.
    return tuple(os.fsencode(e.rel).split(b"/"))


def _pairs(left: Iterator[Entry], right: Iterator[Entry]) -> Iterator[tuple[Entry | None, Entry | None]]:
    """Merge two sorted walks into (before, after) pairs by path."""
    a, b = next(left, None), next(right, None)
    while a is not None or b is not None:
        ka = _key(a) if a is not None else None
        kb = _key(b) if b is not None else None
        if kb is None or (ka is not None and ka < kb):
            yield a, None
            a = next(left, None)
        elif ka is None or kb < ka:
            yield None, b
            b = next(right, None)
        else:
            yield a, b
            a, b = next(left, None), next(right, None)


def _one(
    imps: Importers, before: Tree, after: Tree, a: Entry | None,
    b: Entry | None, max_bytes: int, notes: _Notes, max_changed: int,
) -> bool:  # fmt: skip
    """Add the path to both trees if it differs between input/ and work/.

    A changed file larger than max_diff_bytes is refused before git sees it: git holds both
    versions of a file in memory to diff them, and no reviewer reads a change that large.
    """
    for e in (a, b):
        if (
            e is not None
            and e.kind == "file"
            and e.size > max_changed
            and not (a is not None and b is not None and a.kind == b.kind == "file" and a.size == b.size)
        ):
            raise LimitExceeded(
                f"a changed file is {e.size} bytes, above max_diff_bytes={max_changed}",
                path=fswalk.escape_name(e.rel),
            )
    if b is not None and b.kind == "symlink":
        target = after.readlink(b.rel)
        if a is not None and a.kind == "symlink" and before.readlink(a.rel) == target:
            return False
        _check_link(b.rel, target, notes)
        if a is not None:
            imps[0].add_entry(before, a, max_bytes)
        imps[1].add_data(b"120000", b.rel, target)
        return True
    if a is None or b is None or a.kind != "file" or git_mode(a) != git_mode(b) or a.size != b.size:
        for imp, tree, e in ((imps[0], before, a), (imps[1], after, b)):
            if e is not None:
                imp.add_entry(tree, e, max_bytes)
        return True
    return _compare_files(imps, before, after, a, b, max_bytes, max_changed)


def _compare_files(
    imps: Importers,
    before: Tree,
    after: Tree,
    a: Entry,
    b: Entry,
    max_bytes: int,
    max_changed: int,
) -> bool:
    fa, size_a = before.open(a.rel, max_bytes=max_bytes)
    try:
        fb, size_b = after.open(b.rel, max_bytes=max_bytes)
        try:
            if size_a != size_b:
                same, da, db = False, None, None
            elif size_a <= CHUNK:  # the usual case: one read each, kept if it differs
                da, db = fswalk.read_exact(fa, size_a), fswalk.read_exact(fb, size_b)
                same = da == db
            else:
                same, da, db = _same_stream(fa, fb, size_a), None, None
            if same:
                return False
            if size_b > max_changed:
                raise LimitExceeded(
                    f"a changed file is {size_b} bytes, above max_diff_bytes={max_changed}",
                    path=fswalk.escape_name(b.rel),
                )
            imps[0].add_fd(git_mode(a), a.rel, fa, size_a, da)
            imps[1].add_fd(git_mode(b), b.rel, fb, size_b, db)
            return True
        finally:
            os.close(fb)
    finally:
        os.close(fa)


def _same_stream(fa: int, fb: int, size: int) -> bool:
    left = size
    while left:
        n = min(CHUNK, left)
        if fswalk.read_exact(fa, n) != fswalk.read_exact(fb, n):
            return False
        left -= n
    return True


def _check_link(rel: str, target: bytes, notes: _Notes) -> None:
    """Warn about a link pointing out of the project: harmless as data, a trap once applied."""
    where = posixpath.normpath(posixpath.join(posixpath.dirname(os.fsencode(rel)), target))
    if target.startswith(b"/") or where == b".." or where.startswith(b"../"):
        shown = escape_name(os.fsdecode(target))
        notes.add(f"symlink {escape_name(rel)} points outside the project: {shown}")


def _numstat(raw: bytes, notes: _Notes) -> DiffStat:
    """The stat from `diff-tree --numstat -z` (one record per path, a type change included)."""
    st = DiffStat()
    for rec in raw.split(b"\0"):
        if not rec:
            continue
        added, deleted, path = rec.split(b"\t", 2)
        shown = escape_name(os.fsdecode(path))
        st.files += 1
        st.paths.append(shown)
        if added == b"-":
            st.binary += 1
        else:
            st.insertions += int(added)
            st.deletions += int(deleted)
        if path.rpartition(b"/")[2].lower() in _SPECIAL_NAMES:
            notes.add(f"changes {shown}: git in the project honours it once applied")
        if shown != os.fsdecode(path):
            notes.add(f"unusual file name (shown escaped): {shown}")
    return st


def _write_temp(job_dir: Path, name: str, chunks: Iterator[bytes], max_bytes: int) -> tuple[Path, str, int]:
    """Write the patch to a new temporary file in job_dir; return (path, sha256, size).

    The engine could write in job_dir: mkstemp's O_CREAT|O_EXCL never opens what it planted.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=job_dir)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o644)
            for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise LimitExceeded(
                        f"the patch is larger than max_diff_bytes={max_bytes}", path=job_dir / name
                    )
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp), digest.hexdigest(), size


def _publish(tmp: Path, dest: Path) -> Path:
    """Rename into place: whatever the engine planted at `dest` (a symlink, a file) is replaced,
    never written through."""
    try:
        os.replace(tmp, dest)
    except OSError as err:
        raise FilaError(f"cannot write the patch: {err.strerror}", path=dest) from None
    dfd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return dest

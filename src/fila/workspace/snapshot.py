"""Snapshots: the targets' files copied once, kept read-only and shared by every job on that state.

A job on the `overlay` strategy copies nothing: input/ is a snapshot, and work/ an overlay whose
lower layer is that snapshot and whose upper layer is the job's own. The snapshot is found by the
targets' manifest (content-addressed), so a later task on an unchanged project pays one stat pass
(as `git status` does) and a task group shares one snapshot; only files whose stat data changed
since the last scan are read again.

Layout under `sandbox/snapshots/` (the host's; no container ever gets a path above a `tree/`):
    <key>/tree/          the files as `jobdir.prepare` copies them into input/ (0644/0755, dirs
                         0755, owned by the engine's uid when fila runs as root: an overlay's
                         copy-up keeps the lower file's owner and mode, and the engine must be
                         able to write its own view of them)
    <key>/manifest.json  what `fila apply` checks the project against, and the tree's totals
    stat/<scope>.json    the stat data and hashes of the last scan of one project + targets
    .lock                held while a snapshot is published or linked to a job, and by gc
    .new-*               snapshots being built (a crash leaves one; gc removes it)
A job holds its snapshot by a hard link of manifest.json at `sandbox/meta/<id>/manifest.json`
(the file apply reads): a snapshot whose manifest has a single link left serves no job, and gc
removes it. Nothing under `<key>/` is written after it is published.

The upper layer the engine leaves is read by `Layers` (for workspace/diff.py), under the
host-side rules of docs/architecture.md, "Threat model in brief": never a symlink followed,
whiteouts (character devices 0/0) are deletions and never files, an opaque directory
(`user.overlay.opaque` or `trusted.overlay.opaque` = "y") hides the lower directory's entries, and
a redirect or metacopy xattr, which fila never enables, is refused rather than guessed at.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import marshal
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.errors import FilaError, LimitExceeded, TargetError
from ..core.layout import Root
from ..core.models import Policy
from ..core.mounts import OverlayVolume
from .fswalk import DIR_FLAGS, Entry, escape_name, kind_of, open_beneath, open_dir, same_file, walk, walk_fd

# Stat data younger than this when the scan started is not trusted next time: a file written twice
# within one timestamp tick keeps its size and times (git's "racily clean" entries).
_RACY_NS = 2_000_000_000
_CHUNK = 1 << 20
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPAQUE = ("user.overlay.opaque", "trusted.overlay.opaque")
# What fila never enables (redirect_dir, metacopy) and what only a lower layer may hold: an upper
# layer carrying one was not made by the mount fila asked for.
_REFUSED_XATTRS = ("redirect", "metacopy", "whiteout", "whiteouts")


@dataclass
class Snapshot:
    key: str
    path: Path  # sandbox/snapshots/<key>
    files: int  # files and symlinks (what prepare reports)
    bytes: int
    entries: int  # every entry of tree/, directories included (the diff's max_work_files count)
    how: str  # "built" | "reused" (stat pass only) | "rehashed" (some files read again)
    hashed: int  # files read to check or build it this time
    warnings: list[str] = field(default_factory=list)

    @property
    def tree(self) -> Path:
        return self.path / "tree"

    @property
    def manifest(self) -> Path:
        return self.path / "manifest.json"


@dataclass
class _Source:
    rel: str
    kind: str  # "file" | "symlink" | "dir"
    mode: int
    sig: list[int]  # size, mtime_ns, ctime_ns, ino, dev, mode: what the stat pass compares


def store(root: Root) -> Path:
    return root.path / "sandbox" / "snapshots"


def _made_store(root: Root) -> Path:
    """The store, 0700: its files belong to the engine's uid when fila runs as root (so it can
    write its overlay view of them), and no process of that uid on the host may reach them. The
    Docker daemon mounts a tree by path as root; a container sees only the tree it was given."""
    d = store(root)
    d.mkdir(parents=True, exist_ok=True)
    if stat.S_IMODE(d.stat().st_mode) != 0o700:
        os.chmod(d, 0o700)
    return d


@contextlib.contextmanager
def _locked(root: Root) -> Iterator[None]:
    d = _made_store(root)
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _walk(
    root: Root,
    project: Path,
    targets: list[str],
    policy: Policy,
    warnings: list[str],
    tree: dict | None = None,
) -> Iterator[tuple[_Source, int, bytes, os.stat_result]]:
    """What prepare copies, in its order and by its rules, each with the fd of its directory and
    its name there (valid until the next item): every open below the project goes through
    directory fds with O_NOFOLLOW, as in prepare, so a directory swapped for a symlink meanwhile
    is never followed. Counts files and bytes against the policy as prepare does. `tree` gets
    what the next stat pass checks (`_unchanged`): each target's stat data and, per directory,
    the names the rules kept with theirs."""
    from .jobdir import excluded_prefixes, exclusion

    prefixes = excluded_prefixes(root, project)
    seen: set[str] = set()
    files = size = 0

    def item(rel: str, st: os.stat_result) -> _Source | None:
        nonlocal files, size
        if rel in seen:
            return None
        seen.add(rel)
        kind = kind_of(st.st_mode)
        if kind == "other":
            warnings.append(f"{rel}: not a regular file, symlink or directory; not copied")
            return None
        mode = 0o777 if kind == "symlink" else (0o755 if st.st_mode & stat.S_IXUSR else 0o644)
        sig = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, st.st_mode]
        if kind == "file":
            size += st.st_size
            if st.st_nlink > 1:
                warnings.append(f"{rel}: hard-linked in the project; copied as a file")
            if size > policy.max_work_bytes:
                raise LimitExceeded(
                    f"targets hold more than max_work_bytes {policy.max_work_bytes} bytes",
                    path=escape_name(rel),
                )
        if kind != "dir":
            files += 1
            if files > policy.max_work_files:
                raise LimitExceeded(f"targets hold more than max_work_files {policy.max_work_files} entries")
        return _Source(rel, kind, mode, sig)

    pfd = open_dir(project)
    try:
        for rel in targets:
            parent, _, base_name = rel.rpartition("/")
            dir_fd = open_beneath(pfd, "" if rel == "." else parent)
            try:
                name = os.fsencode("." if rel == "." else base_name)
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if tree is not None:
                    tree["tops"][rel] = _sig(st)
                if not stat.S_ISDIR(st.st_mode):
                    if (src := item(rel, st)) is not None:
                        yield src, dir_fd, name, st
                    continue
                base = "" if rel == "." else rel + "/"

                def skip(sub: str, is_dir: bool, base: str = base) -> bool:
                    return exclusion(base + sub, is_dir, policy, prefixes) is not None

                if base and (src := item(rel, st)) is not None:
                    yield src, dir_fd, name, st
                tfd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
                try:
                    if not same_file(os.fstat(tfd), st):
                        raise TargetError(f"target {rel!r} was replaced while it was being read")
                    limits = {"max_files": policy.max_work_files, "max_bytes": policy.max_work_bytes}
                    top = b"" if rel == "." else os.fsencode(rel)
                    listed: dict[bytes, list] = tree["dirs"] if tree is not None else {}
                    listed.setdefault(top, [])
                    for f in walk_fd(tfd, label=str(project / rel), skip=skip, **limits):
                        if tree is not None:
                            full = os.fsencode(base + f.entry.rel)
                            listed.setdefault(full.rpartition(b"/")[0] if b"/" in full else top, []).append(
                                [f.name, f.entry.kind == "dir", *_sig(f.st)]
                            )
                        if (src := item(base + f.entry.rel, f.st)) is not None:
                            yield src, f.dir_fd, f.name, f.st
                finally:
                    os.close(tfd)
            finally:
                os.close(dir_fd)
    finally:
        os.close(pfd)


def _sig(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, st.st_mode]


def _unchanged(project: Path, targets: list[str], cache: dict) -> bool:
    """The stat pass of a later task: True when every target, every directory the last scan
    listed and every entry it kept have the stat data they had then (size, times, inode, mode),
    none of it younger than the racy window. A directory whose own stat data is unchanged lists
    the same names (an entry made, removed or renamed moves its mtime), so the rules need not run
    again and nothing is listed or read: one stat per entry, through directory fds opened
    without following a link. Any doubt is False, and the full scan decides."""

    tree, horizon = cache.get("tree"), cache.get("horizon")
    if (
        not isinstance(tree, dict)
        or not isinstance(horizon, int)
        or sorted(tree.get("tops", {})) != sorted(targets)
    ):
        return False
    dirs: dict[bytes, list] = tree["dirs"]
    todo: list[tuple[bytes, int]] = []
    pfd = open_dir(project)
    try:
        for rel in targets:
            want = tree["tops"][rel]
            parent, _, base_name = rel.rpartition("/")
            dfd = open_beneath(pfd, "" if rel == "." else parent)
            try:
                name = "." if rel == "." else base_name
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if _sig(st) != want or want[1] >= horizon:
                    return False
                if stat.S_ISDIR(st.st_mode):
                    fd = os.open(name, DIR_FLAGS, dir_fd=dfd)
                    todo.append((b"" if rel == "." else os.fsencode(rel), fd))
                    if not same_file(os.fstat(fd), st):
                        return False
            finally:
                os.close(dfd)
            while todo:
                key, fd = todo[-1]
                for e in dirs.get(key, ()):
                    s = os.stat(e[0], dir_fd=fd, follow_symlinks=False)
                    if (
                        s.st_mtime_ns >= horizon
                        or s.st_size != e[2]
                        or s.st_mtime_ns != e[3]
                        or s.st_ctime_ns != e[4]
                        or s.st_ino != e[5]
                        or s.st_dev != e[6]
                        or s.st_mode != e[7]
                    ):
                        return False
                    if e[1]:
                        cfd = os.open(e[0], DIR_FLAGS, dir_fd=fd)
                        todo.insert(len(todo) - 1, (key + b"/" + e[0] if key else e[0], cfd))
                        if not same_file(os.fstat(cfd), s):
                            return False
                todo.pop()
                os.close(fd)
    except (OSError, FilaError, KeyError, IndexError, TypeError):
        return False
    finally:
        for _key, fd in todo:
            os.close(fd)
        os.close(pfd)
    return True


def _scope(project: Path, targets: list[str], owner: tuple[int, int] | None, rules: list[str]) -> str:
    """One stat cache per project, targets, owner and deny rules (its listings are the rules')."""
    raw = json.dumps({"project": str(project), "targets": targets, "owner": owner, "rules": rules})
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _key(project: Path, targets: list[str], owner: tuple[int, int] | None, entries: list[list]) -> str:
    """The snapshot's name: a hash of everything that makes its tree and manifest what they are."""
    h = hashlib.sha256()
    h.update(json.dumps({"v": 1, "project": str(project), "targets": targets, "owner": owner}).encode())
    for e in entries:
        h.update(json.dumps(e).encode() + b"\n")
    return h.hexdigest()


def _load_cache(path: Path) -> dict:
    """The last scan of one scope. marshal, not JSON: a later task's whole prepare is this load
    and a stat pass, and it reads 50,000 entries in a few ms; fila alone writes the file, 0600 in a
    directory no container mounts (marshal is not for data someone else could have written)."""
    try:
        data = marshal.loads(path.read_bytes())
    except (OSError, ValueError, EOFError, TypeError):
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("entries"), dict) else {}


def take(
    root: Root,
    task_id: str,
    project: Path,
    targets: list[str],
    policy: Policy,
    *,
    owner: tuple[int, int] | None,
) -> Snapshot:
    """The snapshot of `targets` as they are now, linked to the job `task_id`.

    The first time, one walk copies and hashes every file into a new snapshot. Later, a stat pass
    compares each entry with the last scan's stat data and reads only the files whose data
    changed (or are younger than the racy window); when the resulting manifest names a snapshot
    that exists, that is all. Otherwise a second walk builds the new state, hard-linking the files
    that did not change from the last snapshot. The job's `sandbox/meta/<id>/manifest.json`
    becomes a link to the snapshot's manifest (apply's moved-base check reads it; gc counts the
    links). `targets` are resolve_targets' output."""
    started = time.time_ns()
    cache_path = store(root) / "stat" / f"{_scope(project, targets, owner, policy.deny)}.cache"
    cache = _load_cache(cache_path)
    prev = cache.get("key") if isinstance(cache.get("key"), str) else None
    checked: dict[str, list] = {}  # rel -> sig + sha, as found by this stat pass
    hashed = 0
    tree: dict = {"tops": {}, "dirs": {}}
    if prev is not None and (store(root) / prev / "manifest.json").exists():
        if _unchanged(project, targets, cache):  # the usual later task: nothing else to do
            snap = _attach(
                root, task_id, prev, how="reused", hashed=0, warnings=list(cache.get("warnings", []))
            )
            if snap is not None:
                return snap
        known: dict[str, list] = cache["entries"]
        warnings: list[str] = []
        sources: list[_Source] = []
        stale = False
        for src, dfd, name, st in _walk(root, project, targets, policy, warnings, tree):
            sources.append(src)
            if src.kind == "dir":
                continue
            hit = known.get(src.rel)
            if hit is not None and len(hit) == 7 and hit[:6] == src.sig:
                checked[src.rel] = hit
                continue
            stale = True
            if src.kind == "symlink":
                sha = hashlib.sha256(os.readlink(name, dir_fd=dfd)).hexdigest()
            else:
                from .jobdir import copy_file

                sha = copy_file(dfd, name, st, [], src.mode, policy.max_work_bytes)[1]
                hashed += 1
            checked[src.rel] = [*src.sig, sha]
        if not stale and _listing(sources) == cache.get("listing"):
            snap = _attach(root, task_id, prev, how="reused", hashed=0, warnings=warnings)
            if snap is not None:
                _save_cache(cache_path, sources, checked, prev, started, tree, warnings)
                return snap
        key = _key(project, targets, owner, [[s.rel, s.kind, s.sig[0], checked[s.rel][6], s.mode]
                                             if s.kind != "dir" else [s.rel, "dir", 0, "", 0o755]
                                             for s in sources])  # fmt: skip
        snap = _attach(root, task_id, key, how="rehashed" if hashed else "reused", hashed=hashed,
                       warnings=warnings)  # fmt: skip
        if snap is not None:
            _save_cache(cache_path, sources, checked, key, started, tree, warnings)
            return snap
    else:
        prev = None
    warnings = []
    tree = {"tops": {}, "dirs": {}}
    key, sources, checked, read = _build(root, project, targets, policy, warnings, checked, prev, owner, tree)
    snap = _attach(root, task_id, key, how="built", hashed=hashed + read, warnings=warnings)
    if snap is None:  # collected between its publication and the link: gc cannot win twice in a row
        raise FilaError(f"snapshot {key} vanished while it was being linked", path=store(root))
    _save_cache(cache_path, sources, checked, key, started, tree, warnings)
    return snap


def _listing(sources: list[_Source]) -> str:
    """What the stat pass found, by name and kind: a new or removed empty directory changes it."""
    h = hashlib.sha256()
    for s in sources:
        h.update(os.fsencode(s.rel) + b"\0" + s.kind.encode() + b"\0%d\n" % s.mode)
    return h.hexdigest()


def _build(
    root: Root,
    project: Path,
    targets: list[str],
    policy: Policy,
    warnings: list[str],
    checked: dict[str, list],
    prev: str | None,
    owner: tuple[int, int] | None,
    scanned: dict,
) -> tuple[str, list[_Source], dict[str, list], int]:
    """Copy the targets into a new snapshot and publish it; (key, sources, their stat data and
    hashes, files read). A file whose stat data is the one `checked` holds and whose hash the
    previous snapshot `prev` has at the same path is hard-linked from it, not read."""
    from .jobdir import Dest, copy_file

    d = _made_store(root)
    new = Path(tempfile.mkdtemp(prefix=".new-", dir=d))
    published = False
    prev_tree = d / prev / "tree" if prev else None
    prev_entries = _manifest_entries(d / prev) if prev else {}
    try:
        tree = new / "tree"
        tree.mkdir()
        dest = Dest(tree)
        entries: list[list] = []
        sources: list[_Source] = []
        found: dict[str, list] = {}
        dirs: set[str] = set()
        size_total = read = 0
        try:
            for src, dfd, name, st in _walk(root, project, targets, policy, warnings, scanned):
                sources.append(src)
                rel = src.rel
                parent, _, base = rel.rpartition("/")
                while parent and parent not in dirs:  # made by Dest on the way: chmod/chown later
                    dirs.add(parent)
                    parent = parent.rpartition("/")[0]
                parent = rel.rpartition("/")[0]
                if src.kind == "dir":
                    dest.dir(rel)
                    dirs.add(rel)
                    entries.append([rel, "dir", 0, "", 0o755])
                    continue
                pfd = dest.dir(parent)
                if src.kind == "symlink":
                    target = os.readlink(name, dir_fd=dfd)
                    os.symlink(target, base, dir_fd=pfd)
                    sha, size = hashlib.sha256(target).hexdigest(), len(target)
                else:
                    hit = checked.get(rel)
                    sha = hit[6] if hit is not None and hit[:6] == src.sig else None
                    size = src.sig[0]
                    if not (sha is not None and prev_entries.get(rel) == [rel, "file", size, sha, src.mode]
                            and _link(prev_tree, rel, pfd, base)):  # fmt: skip
                        size, sha = copy_file(dfd, name, st, [(pfd, base)], src.mode,
                                               policy.max_work_bytes - size_total)  # fmt: skip
                        read += 1
                    size_total += size
                if owner is not None:
                    os.chown(base, *owner, dir_fd=pfd, follow_symlinks=False)
                found[rel] = [*src.sig, sha]
                entries.append([rel, src.kind, size, sha, src.mode])
        finally:
            dest.close()
        for rel in ["", *dirs]:  # directories: 0755 whatever the umask, the engine's when it is not us
            p = tree / rel if rel else tree
            os.chmod(p, 0o755)
            if owner is not None:
                os.lchown(p, *owner)
        key = _key(project, targets, owner, entries)
        nfiles = sum(e[1] != "dir" for e in entries)
        manifest = {
            "project": str(project),
            "targets": targets,
            "entries": [
                {"path": e[0], "kind": e[1], "size": e[2], "sha256": e[3], "mode": e[4]}
                for e in entries
                if e[1] != "dir"
            ],
            # entries: what a walk of work/ counts (directories made for a target's parents too)
            "snapshot": {"key": key, "owner": owner, "files": nfiles, "bytes": size_total,
                         "entries": nfiles + len(dirs)},
        }  # fmt: skip
        # Compact: json's C encoder does not indent, and this is 50,000 entries on a large project.
        fsutil.atomic_write(new / "manifest.json", json.dumps(manifest, separators=(",", ":")), mode=0o444)
        # The totals alone, for a later task (the manifest is read only by apply and recovery).
        fsutil.atomic_write(new / "info.json", json.dumps(manifest["snapshot"]), mode=0o444)
        _syncfs(new)  # the files' data on disk before the name that vouches for them exists
        with _locked(root):
            try:
                os.rename(new, d / key)
                published = True
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # Another job built the same state meanwhile: theirs is as good as ours.
        return key, sources, found, read
    finally:
        if not published:
            fsutil.remove_tree(new)


def _link(prev_tree: Path | None, rel: str, dir_fd: int, name: str) -> bool:
    """Share an unchanged file with the previous snapshot (neither is ever written again)."""
    if prev_tree is None:
        return False
    try:
        os.link(prev_tree / rel, name, dst_dir_fd=dir_fd, follow_symlinks=False)
    except OSError:  # that snapshot was collected meanwhile: copy instead
        return False
    return True


def _syncfs(path: Path) -> None:
    fd = os.open(path, DIR_FLAGS)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            os.sync()
    except (OSError, AttributeError):
        os.sync()
    finally:
        os.close(fd)


def _manifest_entries(path: Path) -> dict[str, list]:
    try:
        data = json.loads((path / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return {}
    return {e["path"]: [e["path"], e["kind"], e["size"], e["sha256"], e["mode"]]
            for e in data.get("entries", []) if e.get("kind") == "file"}  # fmt: skip


def _save_cache(
    path: Path,
    sources: list[_Source],
    found: dict[str, list],
    key: str,
    started: int,
    tree: dict,
    warnings: list[str],
) -> None:
    horizon = started - _RACY_NS
    entries = {
        s.rel: found[s.rel]
        for s in sources
        if s.rel in found and s.sig[1] < horizon  # mtime, as git does
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"key": key, "listing": _listing(sources), "entries": entries, "tree": tree,
            "horizon": horizon, "warnings": warnings}  # fmt: skip
    fsutil.atomic_write(path, marshal.dumps(data), mode=0o600)


def _attach(
    root: Root, task_id: str, key: str, *, how: str, hashed: int, warnings: list[str]
) -> Snapshot | None:
    """Link the job to the snapshot `key` (None when there is none); under the store's lock, so
    gc never removes a snapshot between this check and the link."""
    path = store(root) / key
    meta = root.meta(task_id)
    meta.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        try:
            info = json.loads((path / "info.json").read_bytes())
        except (OSError, ValueError, KeyError):
            return None
        link = meta / "manifest.json"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        os.link(path / "manifest.json", link)
    return Snapshot(
        key=key,
        path=path,
        files=info["files"],
        bytes=info["bytes"],
        entries=info["entries"],
        how=how,
        hashed=hashed,
        warnings=list(warnings),
    )


@dataclass
class Collected:
    key: str
    bytes: int


def collect(root: Root, *, dry_run: bool = False, stale_s: float = 86400) -> list[Collected]:
    """Remove the snapshots no job links to any more (their manifest has one link), and builds a
    crash left behind (`.new-*` older than `stale_s`). Runs after gc has removed decided jobs."""
    from .jobdir import usage

    d = store(root)
    if not d.is_dir():
        return []
    out: list[Collected] = []
    doomed: list[Path] = []
    with _locked(root):
        for entry in os.scandir(d):
            p = Path(entry.path)
            if entry.name.startswith(".new-"):
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > stale_s:
                    doomed.append(p)
                continue
            if len(entry.name) != 64 or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                links = os.lstat(p / "manifest.json").st_nlink
            except FileNotFoundError:
                links = 1
            if links <= 1:
                doomed.append(p)
        for p in doomed:
            size = usage(p, max_bytes=1 << 62, max_files=1 << 62)[0]
            if not dry_run:
                gone = d / f".gone-{p.name}"
                os.rename(p, gone)  # out of reach of _attach before the lock is let go
                p = gone
            out.append(Collected(p.name.removeprefix(".gone-"), size))
    if not dry_run:
        for p in d.glob(".gone-*"):
            fsutil.remove_tree(p)
    return out


# --- the upper layer an engine leaves --------------------------------------------------------


def _xattrs(dfd: int, name: str, where: str) -> dict[str, bytes]:
    """The overlay xattrs of one upper entry (read without following it); refuses the ones a
    mount fila made never writes."""
    path = f"/proc/self/fd/{dfd}/{name}"
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.EPERM):
            return {}
        raise FilaError(f"cannot read xattrs: {err.strerror}", path=escape_name(where)) from None
    out: dict[str, bytes] = {}
    for n in names:
        ns, _, attr = n.partition(".overlay.")
        if ns not in ("user", "trusted") or not attr:
            continue
        if attr in _REFUSED_XATTRS:
            raise FilaError(
                f"the overlay's upper layer holds {n}: a redirect, metacopy or whiteout xattr that "
                "fila's mount never makes",
                path=escape_name(where),
                hint="the job's work/ cannot be read safely; remove the job and run the task again",
            )
        with contextlib.suppress(OSError):
            out[n] = os.getxattr(path, n, follow_symlinks=False)
    return out


class Layers:
    """A snapshot (lower) and the upper layer an engine's overlay left, read as the two sides of
    the diff: `upper_walk` gives what the engine's work/ holds that the snapshot does not (every
    upper entry but whiteouts), `lower_walk` what of the snapshot the engine deleted or replaced.
    Unchanged files are never visited: the cost is what the engine changed.

    Both keep fswalk.walk's order and limits; `check_totals` applies max_work_files and
    max_work_bytes to the merged view (the snapshot's totals, less what was hidden, plus the
    upper layer's), as the copy strategy's walk of work/ does."""

    def __init__(self, lower: Path, upper: Path, *, entries: int, bytes_: int) -> None:
        self.lower, self.upper = lower, upper
        self.lower_entries, self.lower_bytes = entries, bytes_
        self.hidden: list[tuple[str, bool]] = []  # (rel, with its subtree): in walk order
        self.upper_entries = self.upper_bytes = 0
        self.hidden_entries = self.hidden_bytes = 0

    def upper_walk(
        self, prune: Callable[[str, bool], bool], *, max_files: int, max_bytes: int
    ) -> Iterator[Entry]:
        from .fswalk import entry_names

        def hide(rel: str, subtree: bool) -> None:
            self.hidden.append((rel, subtree))

        def visit(ufd: int, lfd: int | None, prefix: str, depth: int) -> Iterator[Entry]:
            for raw, name in entry_names(ufd, prefix, max_files, max_files):
                rel = prefix + name
                try:
                    st = os.stat(raw, dir_fd=ufd, follow_symlinks=False)
                except OSError as err:
                    raise FilaError(f"cannot stat: {err.strerror}", path=escape_name(rel)) from None
                low = None
                if lfd is not None:
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        low = os.stat(raw, dir_fd=lfd, follow_symlinks=False)
                xattrs = _xattrs(ufd, name, rel)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout: a deletion
                    if low is not None:
                        hide(rel, True)
                    continue
                kind = kind_of(st.st_mode)
                opaque = kind == "dir" and any(xattrs.get(n) == b"y" for n in _OPAQUE)
                merge = kind == "dir" and not opaque and low is not None and stat.S_ISDIR(low.st_mode)
                if low is not None:
                    hide(rel, not merge)
                if prune(rel, kind == "dir"):
                    continue
                if depth > 64:
                    raise LimitExceeded("tree deeper than max_depth=64", path=escape_name(rel))
                if len(os.fsencode(rel)) > 4096:
                    raise LimitExceeded("path longer than max_path_bytes=4096",
                                        path=escape_name(rel[:200]) + "...")  # fmt: skip
                self.upper_entries += 1
                if self.upper_entries > max_files:
                    raise LimitExceeded(f"more than max_files={max_files} entries", path=self.upper)
                if kind == "file":
                    self.upper_bytes += st.st_size
                    if self.upper_bytes > max_bytes:
                        raise LimitExceeded(f"files total more than max_bytes={max_bytes}",
                                            path=escape_name(rel))  # fmt: skip
                yield Entry(rel, kind, st.st_mode, st.st_size, st.st_nlink)
                if kind != "dir":
                    continue
                cfd = os.open(raw, DIR_FLAGS, dir_fd=ufd)
                clfd = None
                try:
                    if merge:
                        clfd = os.open(raw, DIR_FLAGS, dir_fd=lfd)
                    yield from visit(cfd, clfd, rel + "/", depth + 1)
                finally:
                    os.close(cfd)
                    if clfd is not None:
                        os.close(clfd)

        ufd, lfd = open_dir(self.upper), open_dir(self.lower)
        try:
            yield from visit(ufd, lfd, "", 1)
        finally:
            os.close(ufd)
            os.close(lfd)

    def lower_walk(self, prune: Callable[[str, bool], bool]) -> Iterator[Entry]:
        """The snapshot's entries the upper layer hid, in walk order (call after upper_walk)."""
        for rel, subtree in self.hidden:
            st = os.lstat(self.lower / rel)
            kind = kind_of(st.st_mode)
            self._count(kind, st.st_size)
            if prune(rel, kind == "dir"):
                continue
            yield Entry(rel, kind, st.st_mode, st.st_size, st.st_nlink)
            if kind == "dir" and subtree:

                def skip(sub: str, is_dir: bool, base: str = rel + "/") -> bool:
                    return prune(base + sub, is_dir)

                for e in walk(self.lower / rel, skip=skip, max_files=1 << 62, max_bytes=1 << 62):
                    self._count(e.kind, e.size)
                    yield Entry(f"{rel}/{e.rel}", e.kind, e.mode, e.size, e.nlink)

    def _count(self, kind: str, size: int) -> None:
        self.hidden_entries += 1
        if kind == "file":
            self.hidden_bytes += size

    def check_totals(self, *, max_files: int, max_bytes: int) -> None:
        """work/ as the engine left it, held to the limits the copy strategy's walk applies."""
        files = self.lower_entries - self.hidden_entries + self.upper_entries
        size = self.lower_bytes - self.hidden_bytes + self.upper_bytes
        if files > max_files:
            raise LimitExceeded(f"more than max_files={max_files} entries", path=self.upper)
        if size > max_bytes:
            raise LimitExceeded(f"files total more than max_bytes={max_bytes}", path=self.upper)


# --- a job on the overlay strategy -----------------------------------------------------------

# Characters the overlay's mount options cannot carry in a path (lowerdir lists are ':'-separated,
# options ','-separated, and the kernel reads '\' as an escape).
_UNMOUNTABLE = (",", ":", "\\", "\n")


@dataclass(frozen=True)
class Overlay:
    """The layers of one job's work/: the snapshot (lower, read-only, shared), the job's upper
    layer and the overlay's own scratch directory (its `workdir`), both under the job's meta
    directory, which no container mounts."""

    lower: Path
    upper: Path
    scratch: Path
    entries: int  # the snapshot's totals, for the diff's limits
    bytes: int

    def layers(self) -> Layers:
        return Layers(self.lower, self.upper, entries=self.entries, bytes_=self.bytes)

    def volume(self, target: str) -> OverlayVolume:
        """work/ as the overlay volume a backend mounts at `target`."""
        return OverlayVolume(target, self.lower, self.upper, self.scratch)


def choose(root: Root, unsupported: str | None) -> tuple[str, str]:
    """("overlay" | "copy", why). `unsupported` is the backend's reason it cannot mount an overlay
    volume here (None: it can). FILA_WORKSPACE=copy forces the copy (a benchmark's baseline, or a
    host whose overlay misbehaves)."""
    forced = os.environ.get("FILA_WORKSPACE", "")
    if forced == "copy":
        return "copy", "FILA_WORKSPACE=copy"
    if unsupported:
        return "copy", unsupported
    where = str(root.path / "sandbox")
    if any(c in where for c in _UNMOUNTABLE):
        return (
            "copy",
            f"the queue root's path holds one of {' '.join(map(repr, _UNMOUNTABLE))}, which overlay "
            "mount options cannot carry",
        )
    return (
        "overlay",
        "work/ is an overlay on a shared snapshot of the targets; only the job's upper layer is read",
    )


def prepare_job(
    root: Root,
    task_id: str,
    task: Any,
    policy: Policy,
    effective: Any,
    *,
    owner: tuple[int, int] | None,
    task_md_extra: str = "",
) -> tuple[Any, Overlay, Snapshot]:
    """`jobdir.prepare` for the overlay strategy: the job directory holds TASK.md and two empty
    mount points; input/ is the snapshot's tree and work/ the overlay the backend mounts. The
    upper layer's root is the engine's (`owner`, when fila runs as root): the overlay's root
    directory takes its owner and mode from it."""
    from .jobdir import Prepared, project_of, resolve_targets, task_md

    project = project_of(root, task, policy)
    targets = resolve_targets(root, project, task.targets, policy)
    job, ov = root.job_dir(task_id), root.overlay_dir(task_id)
    for old in (job, ov):
        if old.exists() or old.is_symlink():  # a requeued task starts from a clean state
            fsutil.remove_tree(old)
    (job / "input").mkdir(parents=True)
    (job / "work").mkdir()
    snap = take(root, task_id, project, targets, policy, owner=owner)
    upper, scratch = ov / "upper", ov / "work"
    upper.mkdir(parents=True)
    scratch.mkdir()
    os.chmod(upper, 0o755)
    if owner is not None:
        os.chown(upper, *owner)
    prep = Prepared(
        job_dir=job, files=snap.files, bytes=snap.bytes, manifest=[], warnings=list(snap.warnings)
    )
    fsutil.atomic_write(
        job / "TASK.md", task_md(task_id, task, targets, policy, effective, prep, task_md_extra)
    )
    return prep, Overlay(snap.tree, upper, scratch, snap.entries, snap.bytes), snap


def job_overlay(root: Root, task_id: str) -> Overlay | None:
    """The layers of a job prepared on the overlay strategy (its manifest names a snapshot);
    None for a copied job."""
    try:
        info = json.loads((root.meta(task_id) / "manifest.json").read_bytes()).get("snapshot")
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("key"), str):
        return None
    ov = root.overlay_dir(task_id)
    tree = store(root) / info["key"] / "tree"
    return Overlay(tree, ov / "upper", ov / "work", int(info["entries"]), int(info["bytes"]))


class MergedView:
    """work/ of an overlay job as the engine left it, read path by path from the layers without a
    mount (what `fila apply` compares the patched files with): the upper layer's entry when it has
    one (a whiteout: absent), else the snapshot's, unless an opaque directory or a non-directory
    of the upper layer hides it. Same answers as safedir.SafeDir.state on the copied work/."""

    def __init__(self, overlay: Overlay) -> None:
        from .safedir import SafeDir

        self.low = SafeDir(overlay.lower)
        try:
            self.up = SafeDir(overlay.upper)
        except BaseException:
            self.low.__exit__()
            raise

    def __enter__(self) -> MergedView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.low.__exit__()
        self.up.__exit__()

    def _opaque(self, rel: str) -> bool:
        with self.up.parent(rel) as (dfd, name):
            path = f"/proc/self/fd/{dfd}/{name}"
            for n in _OPAQUE:
                with contextlib.suppress(OSError):
                    if os.getxattr(path, n, follow_symlinks=False) == b"y":
                        return True
        return False

    def state(self, rel: str, *, max_bytes: int) -> Any:
        from .safedir import ABSENT

        parts = rel.split("/")
        lower_visible = True
        for i in range(len(parts)):
            pre = "/".join(parts[: i + 1])
            st = self.up.lstat(pre)
            if st is None:
                break  # the upper layer has nothing here, so nothing deeper either
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                return ABSENT  # a whiteout: deleted, and everything below it
            if i == len(parts) - 1 or not stat.S_ISDIR(st.st_mode):
                return self.up.state(rel, max_bytes=max_bytes)
            low = self.low.lstat(pre) if lower_visible else None
            if self._opaque(pre) or (low is not None and not stat.S_ISDIR(low.st_mode)):
                lower_visible = False
        return self.low.state(rel, max_bytes=max_bytes) if lower_visible else ABSENT

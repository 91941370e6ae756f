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

A job on the overlay strategy gets its snapshot, its upper layer and its view of work/ from
workspace/overlay.py.

Building, reusing and linking a snapshot share the stat pass, its cache and their helpers, so they
are one module; collecting snapshots (workspace/snapshot_gc.py) needs only the store's path and
its lock (`locked`), and lives on its own.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..core import fsutil
from ..core.errors import FilaError, LimitExceeded, TargetError
from ..core.layout import Root
from ..core.models import Policy
from .fswalk import DIR_FLAGS, escape_name, kind_of, open_beneath, open_dir, same_file, walk_fd

# Stat data younger than this when the scan started is not trusted next time: a file written twice
# within one timestamp tick keeps its size and times (git's "racily clean" entries).
_RACY_NS = 2_000_000_000
_CHUNK = 1 << 20
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
def locked(root: Root) -> Iterator[None]:
    """The store's lock: held while a snapshot is published or linked to a job, and while
    snapshot_gc collects, so a snapshot is never removed between a job's check and its link."""
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
        with locked(root):
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
    with locked(root):
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

"""The overlay strategy's side of a job (docs/architecture.md, "The Workspace seam"): whether a
job runs on it (`choose`), its job directory on a shared snapshot (`prepare_job`, `job_overlay`),
and the upper layer the engine leaves, read without a mount.

The upper layer is read by `Layers` (for workspace/diff.py) and `MergedView` (for `fila apply`),
under the host-side rules of docs/architecture.md, "Threat model in brief": never a symlink
followed, whiteouts (character devices 0/0) are deletions and never files, an opaque directory
(`user.overlay.opaque` or `trusted.overlay.opaque` = "y") hides the lower directory's entries, and
a redirect or metacopy xattr, which fila never enables, is refused rather than guessed at.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.errors import FilaError, LimitExceeded
from ..core.layout import Root
from ..core.models import Policy
from ..core.mounts import OverlayVolume
from .fswalk import DIR_FLAGS, Entry, escape_name, kind_of, open_dir, walk
from .snapshot import Snapshot, store, take

_OPAQUE = ("user.overlay.opaque", "trusted.overlay.opaque")
# What fila never enables (redirect_dir, metacopy) and what only a lower layer may hold: an upper
# layer carrying one was not made by the mount fila asked for.
_REFUSED_XATTRS = ("redirect", "metacopy", "whiteout", "whiteouts")


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

"""work/ between the host and the engine (docs/architecture.md, "The Workspace seam",
`hand_over` and `reclaim`): given to the engine's uid before the container starts, counted while
it runs (`usage`, the heartbeat's disk limits), and made inert after it is gone, before the host
reads anything the engine left (docs/architecture.md, "Threat model in brief").
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

from ..core import fsutil
from ..core.errors import FilaError
from .fswalk import escape_name

# What the host put in the job directory; anything else there was left by the engine.
JOB_ENTRIES = {"input", "work", "TASK.md", "DIFF.patch"}


def _tool(*argv: str) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, errors="surrogateescape")
    if res.returncode != 0:
        raise OSError(f"{argv[0]} failed on the job directory: {res.stderr.strip()[:500]}")
    return res.stdout


def hand_over(job_dir: Path, uid: int, gid: int) -> None:
    """Give work/ to the container's user (when it is not the host user, e.g. fila runs as
    root and the engine must not). Only work/: the job directory itself stays the host's. What
    keeps the engine from writing beside work/ in either mode is the read-only mount of the job
    directory (sandbox.create_kwargs); ownership is the second wall when fila runs as root."""
    work = job_dir / "work"
    if _empty_dir(work):  # an overlay job's work/ (a mount point): no chown process for one inode
        os.lchown(work, uid, gid)
        return
    _tool("chown", "-R", "-h", f"{uid}:{gid}", "--", str(work))


def _empty_dir(path: Path) -> bool:
    """A directory (never a link to one) with nothing in it."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        with os.scandir(path) as it:
            return next(it, None) is None
    except OSError:
        return False  # the tools report it


def reclaim(job_dir: Path, *, owner: tuple[int, int] | None = None) -> list[str]:
    """After the container is gone: make what the engine left inert before the host reads it.

    The engine could write anything it could reach; left as is, that runs on the host later (a
    setuid binary, a `.git/config` with core.fsmonitor that a `git status` in work/ executes,
    a conftest.py beside work/ that pytest at the project root picks up). So: remove everything
    beside input/, work/, TASK.md and DIFF.patch; give work/ back to the host user; strip
    setuid/setgid/sticky and group/other write bits (never adding one: the diff reads the exec
    bit); remove `.git` entries in work/ (never copied in, never applied). No attacker is live
    now, and the real tools (chown, chmod, find) never follow a symlink below their argument.
    """
    warnings: list[str] = []
    for entry in os.scandir(job_dir):
        if entry.name not in JOB_ENTRIES or (
            entry.name in {"TASK.md", "DIFF.patch"} and not entry.is_file(follow_symlinks=False)
        ):
            warnings.append(f"the engine left {escape_name(entry.name)!s} beside work/; removed")
            fsutil.remove_tree(Path(entry.path))
    work = job_dir / "work"
    if work.is_symlink() or not work.is_dir():
        return warnings  # the diff refuses it, and says so
    return warnings + _inert_or_removed(work, owner, whiteouts=False, shown=job_dir)


def reclaim_tree(upper: Path, *, owner: tuple[int, int] | None = None) -> list[str]:
    """`reclaim` for an overlay job's upper layer (what the engine wrote over the snapshot, kept
    under the job's meta directory): made inert the same way, or removed with an error."""
    if upper.is_symlink() or not upper.is_dir():
        return []  # the diff refuses it, and says so
    return _inert_or_removed(upper, owner, whiteouts=True, shown=upper)


def _inert_or_removed(
    tree: Path, owner: tuple[int, int] | None, *, whiteouts: bool, shown: Path
) -> list[str]:
    """`tree` made inert, or removed with the error that fails the task: whatever is left may be
    live (a .git/config with core.fsmonitor, a setuid file), and no diff may come from it."""
    try:
        return _make_inert(tree, owner, whiteouts=whiteouts)
    except (OSError, FilaError) as err:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            fsutil.remove_tree(tree)
        raise FilaError(
            f"work/ could not be made safe after the run ({err}); it was removed, no diff is taken",
            path=shown,
        ) from None


def _open_up(work: Path) -> None:
    """Give every directory below work/ back u+rwx, through fds and never following a link: an
    engine running as fila's own user (fila not root) can chmod 000 a directory, and find
    could not go in to strip what lies there. Only directories: the diff reads files' modes.
    Depth first, one fd per level open."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def entered(fd: int) -> tuple[int, Iterator[str]]:
        st = os.fstat(fd)
        if st.st_mode & 0o700 != 0o700:
            # fchmod refuses an O_PATH fd; its /proc link names this very inode.
            os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(st.st_mode) | 0o700)
        with os.scandir(f"/proc/self/fd/{fd}") as it:
            names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
        return fd, iter(names)

    stack = [entered(os.open(work, flags))]
    try:
        while stack:
            fd, names = stack[-1]
            name = next(names, None)
            if name is None:
                os.close(stack.pop()[0])
                continue
            try:
                cfd = os.open(name, flags, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                stack.append(entered(cfd))
            except BaseException:
                os.close(cfd)
                raise
    finally:
        for fd, _names in stack:
            os.close(fd)


def _make_inert(work: Path, owner: tuple[int, int] | None, *, whiteouts: bool = False) -> list[str]:
    """`whiteouts`: `work` is an overlay's upper layer, whose deletions are character devices
    the daemon made (root's): chmod goes around them, a non-root fila may not touch them."""
    warnings: list[str] = []
    _open_up(work)
    if _empty_dir(work):
        # Nothing below it (an overlay job's work/ on the host, a mount point the engine never
        # sees): what find, chown and chmod do to the directory alone, without three processes.
        st = os.lstat(work)
        if owner is not None and (st.st_uid, st.st_gid) != owner:
            os.lchown(work, *owner)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o7022:
            os.chmod(work, mode & ~0o7022)
        if mode & 0o7000:
            warnings.append("setuid/setgid/sticky bits stripped in work/: .")
        return warnings
    # One pass over work/ finds both what to strip and what to remove, before chown (which clears
    # setuid bits by itself and would hide them); chmod runs only when something needs it.
    found = _tool(
        "find",
        str(work),
        "(",
        "-iname",
        ".git",
        "-prune",
        "-printf",
        "G%p\\0",
        ")",
        "-o",
        "(",
        "-not",
        "-type",
        "l",
        "-perm",
        "/7022",
        "-printf",
        "M%m %p\\0",
        ")",
    )
    gits, loose, special = [], False, []
    for item in (x for x in found.split("\0") if x):
        if item[0] == "G":
            gits.append(item[1:])
            continue
        mode, _, name = item[1:].partition(" ")
        loose = True
        if int(mode, 8) & 0o7000:
            special.append(name)
    if owner is not None:
        _tool("chown", "-R", "-h", f"{owner[0]}:{owner[1]}", "--", str(work))
    if special:
        warnings.append(
            "setuid/setgid/sticky bits stripped in work/: "
            + ", ".join(escape_name(os.path.relpath(n, work)) for n in special[:5])
        )
    if loose and whiteouts:
        _tool("find", str(work), "-not", "-type", "l", "-not", "-type", "c", "-perm", "/7022",
              "-exec", "chmod", "ug-s,-t,go-w", "--", "{}", "+")  # fmt: skip
    elif loose:
        _tool("chmod", "-R", "ug-s,-t,go-w", "--", str(work))
    for name in gits:
        warnings.append(
            f"removed {escape_name(os.path.relpath(name, work))} from work/: "
            "git metadata is never copied in or applied"
        )
        fsutil.remove_tree(Path(name))
    return warnings


def usage(job_dir: Path, *, max_bytes: int, max_files: int) -> tuple[int, int]:
    """Disk blocks (bytes) and entries under the job directory, counted while the engine runs;
    stops counting once past either limit. A bind mount has no quota of its own, so this is
    what keeps an engine from filling the host's disk or inodes."""
    used = files = 0
    stack = [str(job_dir)]
    while stack and used <= max_bytes and files <= max_files:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    files += 1
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue  # removed meanwhile: the engine is live
                    used += st.st_blocks * 512  # blocks, not st_size: sparse files cost nothing
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
        except OSError:
            continue  # unreadable, vanished, or a path too long to name: skip it
    return used, files

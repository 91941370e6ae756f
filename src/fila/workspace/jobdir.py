"""The job directory: `sandbox/jobs/<id>/{input,work,TASK.md}`, prepared from the project.

Targets are copied into both input/ (pristine, mounted read-only) and work/ (the engine's).
`fila/`, `sandbox/`, `.git/` and the policy's deny globs are never copied; a target outside the
project is refused; symlinks are copied as links, never followed. The manifest of what was copied
(path, size, sha256, mode) is kept host-side in `sandbox/meta/<id>/manifest.json`, where the
engine cannot reach it, so `apply` can tell whether the project moved since.

Handing work/ to the engine, and making what it left inert, is workspace/handover.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from ..core import fsutil
from ..core.errors import LimitExceeded, TargetError
from ..core.layout import Root
from ..core.models import Policy, Task
from ..queue.policy import Effective, denied_by
from .fswalk import DIR_FLAGS, escape_name, kind_of, open_beneath, open_dir, same_file, walk_fd

ALWAYS_EXCLUDED = (".git",)


@dataclass
class ManifestEntry:
    path: str
    kind: str  # "file" | "symlink"
    size: int
    sha256: str
    mode: int  # 0o644 / 0o755 for files, 0o777 for symlinks


@dataclass
class Prepared:
    job_dir: Path
    files: int
    bytes: int
    manifest: list[ManifestEntry]
    warnings: list[str] = field(default_factory=list)


def allowed_projects(root: Root, policy: Policy) -> list[Path]:
    """The directories a task may name as its project: the queue root, and the policy's
    `projects` (the operator's file; a task only picks a policy by name). Real paths."""
    return [Path(os.path.realpath(d)) for d in (root.path, *policy.projects)]


def project_of(root: Root, task: Task, policy: Policy) -> Path:
    """The task's project as a real path, refused unless it is exactly an allowed directory:
    whoever writes a task file may have fewer rights than fila, which reads the project and
    apply writes there. Symlinks and `..` are resolved before the comparison, so a link into a
    forbidden place is refused and a link to an allowed one resolves to it."""
    raw = task.project or str(root.path)
    if "\x00" in raw:  # no path holds one; realpath would raise
        raise TargetError(f"project {escape_name(raw)} holds a NUL character", hint="name a directory")
    p = Path(raw)
    real = Path(os.path.realpath(p if p.is_absolute() else root.path / p))
    allowed = allowed_projects(root, policy)
    if real not in allowed:
        raise TargetError(
            f"project {escape_name(raw)} (real path {escape_name(str(real))}) is not allowed: policy "
            f"{task.policy!r} field 'projects' allows "
            + ", ".join(escape_name(str(a)) for a in allowed[1:])
            + (" and " if len(allowed) > 1 else "")
            + f"the queue root {escape_name(str(allowed[0]))} only",
            hint="an operator adds the directory to the policy's `projects` (policies/"
            f"{task.policy}.json), or submit from that project's own queue root",
        )
    return real


def excluded_prefixes(root: Root, project: Path, *extra: Path) -> list[str]:
    """The queue's own directories, relative to the project, when they lie inside it."""
    out = []
    for d in (root.fila, root.path / "sandbox", *extra):
        with contextlib.suppress(ValueError):
            out.append(d.relative_to(project).as_posix())
    return out


def exclusion(rel: str, is_dir: bool, policy: Policy, prefixes: list[str]) -> str | None:
    if any(rel == p or rel.startswith(p + "/") for p in prefixes):
        return "fila's own directories"
    if any(part in ALWAYS_EXCLUDED for part in rel.split("/")):
        return ".git/"
    rule = denied_by(rel, is_dir, policy.deny)
    return f"deny rule {rule!r}" if rule else None


def diff_skip(root: Root, project: Path, policy: Policy) -> Callable[[str, bool], bool]:
    """What the diff leaves out of work/: what is never copied in is never applied either (an
    engine writing work/fila/in/x.json must not queue a task when the patch is applied)."""
    prefixes = excluded_prefixes(root, project, root.policies_dir)
    return lambda rel, is_dir: exclusion(rel, is_dir, policy, prefixes) is not None


def _resolve_one(project: Path, raw: str, policy: Policy, prefixes: list[str]) -> str:
    pure = PurePosixPath(raw)
    if pure.is_absolute() or ".." in pure.parts:
        raise TargetError(
            f"target {raw!r} is outside the project",
            hint="targets are paths relative to the project root, without '..'",
            path=project,
        )
    rel = pure.as_posix().strip("/")
    if rel in ("", "."):
        rel = "."
    cur = project
    parts = [] if rel == "." else list(PurePosixPath(rel).parts)
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = cur.lstat()
        except FileNotFoundError:
            raise TargetError(f"target {raw!r} does not exist", path=cur) from None
        if stat.S_ISLNK(st.st_mode):
            resolved = cur.resolve()
            if not resolved.is_relative_to(project):
                raise TargetError(
                    f"target {raw!r} is a symlink pointing outside the project (to {resolved})",
                    path=cur,
                )
            if i < len(parts) - 1:
                raise TargetError(
                    f"target {raw!r} goes through the symlink {'/'.join(parts[: i + 1])!r}",
                    hint="name the real path instead",
                    path=cur,
                )
    if rel != ".":
        why = exclusion(rel, (project / rel).is_dir(), policy, prefixes)
        if why:
            raise TargetError(f"target {raw!r} is never copied ({why})", path=project / rel)
    return rel


def resolve_targets(root: Root, project: Path, targets: list[str], policy: Policy) -> list[str]:
    """Normalise targets to project-relative paths; refuse what is outside, missing or denied."""
    prefixes = excluded_prefixes(root, project)
    out: list[str] = []
    kept: set[str] = set()  # a list's `in` made 40,000 targets cost 30 s per call
    for raw in targets:
        try:
            rel = _resolve_one(project, raw, policy, prefixes)
        except OSError as err:  # a path too long for the kernel, an unreadable directory
            if fsutil.host_fault(err):  # the host's (no descriptors, an I/O error): not the task's
                raise
            raise TargetError(
                f"target {escape_name(raw[:200])}{'...' if len(raw) > 200 else ''} cannot be read: "
                f"{err.strerror}",
                hint="name a shorter path, or one fila can read",
                path=project,
            ) from None
        if rel not in kept:
            kept.add(rel)
            out.append(rel)
    return out


_SRC_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DST_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Dest:
    """input/ or work/ of the job being prepared, written through directory fds only: no path
    below it is ever resolved by the kernel from the top, so nothing swapped in meanwhile is
    followed. The last parent's fd is cached (entries come depth first)."""

    def __init__(self, path: Path) -> None:
        self.fd = open_dir(path)
        self._last: tuple[str, int] | None = None

    def close(self) -> None:
        self._drop()
        os.close(self.fd)

    def _drop(self) -> None:
        if self._last is not None:
            os.close(self._last[1])
            self._last = None

    def dir(self, rel: str) -> int:
        """The fd of directory `rel` (made if missing); borrowed until the next call."""
        if not rel:
            return self.fd
        if self._last is not None and self._last[0] == rel:
            return self._last[1]
        self._drop()
        fd = os.dup(self.fd)
        try:
            for part in rel.split("/"):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        self._last = (rel, fd)
        return fd


def copy_file(
    src_dir: int, name: bytes, walked: os.stat_result, dsts: list[tuple[int, str]], mode: int, max_bytes: int
) -> tuple[int, str]:
    """Read once, write to every destination, hash on the way. Never follows a link or blocks.

    `name` is opened relative to its directory's fd, and must still be the file the walk saw
    (device and inode): a name swapped for another file after the listing is refused."""
    where = escape_name(os.fsdecode(name))
    try:
        fd = os.open(name, _SRC_FLAGS, dir_fd=src_dir)
    except OSError as err:
        if fsutil.host_fault(err):  # the host's (no descriptors, an I/O error): not the task's
            raise
        raise TargetError(f"cannot open {where} in the project: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not same_file(st, walked):
            raise TargetError(f"{where} was replaced while it was being copied", hint="submit it again")
        if st.st_size > max_bytes:
            raise LimitExceeded(f"{where} is {st.st_size} bytes, above max_work_bytes {max_bytes}")
        h = hashlib.sha256()
        outs: list[int] = []
        try:
            for dfd, dname in dsts:
                outs.append(os.open(dname, _DST_FLAGS, mode, dir_fd=dfd))
                os.fchmod(outs[-1], mode)  # the umask must not decide what the engine and the diff see
            size = 0
            while chunk := os.read(fd, 1 << 20):
                h.update(chunk)
                size += len(chunk)
                if size > max_bytes:  # grew after the fstat
                    raise LimitExceeded(f"{where} grew above max_work_bytes {max_bytes} while copied")
                for o in outs:
                    os.write(o, chunk)
        finally:
            for o in outs:
                os.close(o)
        return size, h.hexdigest()
    finally:
        os.close(fd)


def prepare(
    root: Root,
    task_id: str,
    task: Task,
    policy: Policy,
    effective: Effective,
    *,
    task_md_extra: str = "",
) -> Prepared:
    project = project_of(root, task, policy)
    targets = resolve_targets(root, project, task.targets, policy)
    prefixes = excluded_prefixes(root, project)
    job = root.job_dir(task_id)
    if job.exists() or job.is_symlink():
        # A requeued task starts from a clean copy (a first attempt may have left anything).
        fsutil.remove_tree(job)
    (job / "input").mkdir(parents=True)
    (job / "work").mkdir()
    prep = Prepared(job_dir=job, files=0, bytes=0, manifest=[])
    seen: set[str] = set()
    # Every open below the project goes through directory fds taken one component at a time
    # with O_NOFOLLOW (resolve_targets checked paths, but whoever writes in the project can swap
    # a directory for a symlink after that): nothing outside the project can be reached.
    stack = contextlib.ExitStack()
    pfd = open_dir(project)
    stack.callback(os.close, pfd)
    ins = Dest(job / "input")
    stack.callback(ins.close)
    wrk = Dest(job / "work")
    stack.callback(wrk.close)

    def add(rel: str, src_dir: int, name: bytes, kind: str, st: os.stat_result) -> None:
        if rel in seen:
            return
        seen.add(rel)
        parent, _, base = rel.rpartition("/")
        if kind == "dir":
            ins.dir(rel)
            wrk.dir(rel)
            return
        if kind == "symlink":
            target = os.readlink(name, dir_fd=src_dir)  # bytes: data, never followed
            os.symlink(target, base, dir_fd=ins.dir(parent))
            os.symlink(target, base, dir_fd=wrk.dir(parent))
            prep.manifest.append(
                ManifestEntry(rel, "symlink", len(target), hashlib.sha256(target).hexdigest(), 0o777)
            )
        elif kind == "file":
            mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
            dsts = [(ins.dir(parent), base), (wrk.dir(parent), base)]
            size, sha = copy_file(src_dir, name, st, dsts, mode, policy.max_work_bytes - prep.bytes)
            prep.bytes += size
            prep.manifest.append(ManifestEntry(rel, "file", size, sha, mode))
            if st.st_nlink > 1:
                prep.warnings.append(f"{rel}: hard-linked in the project; copied as a file")
        else:
            prep.warnings.append(f"{rel}: not a regular file, symlink or directory; not copied")
            return
        prep.files += 1
        if prep.files > policy.max_work_files:
            raise LimitExceeded(
                f"targets hold more than max_work_files {policy.max_work_files} entries",
                task_id=task_id,
            )

    with stack:
        for rel in targets:
            parent, _, base_name = rel.rpartition("/")
            dir_fd = open_beneath(pfd, "" if rel == "." else parent)
            try:
                name = os.fsencode("." if rel == "." else base_name)
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    base = "" if rel == "." else rel + "/"

                    def skip(sub: str, is_dir: bool, base: str = base) -> bool:
                        return exclusion(base + sub, is_dir, policy, prefixes) is not None

                    if base:
                        add(rel, dir_fd, name, "dir", st)
                    tfd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        if not same_file(os.fstat(tfd), st):
                            raise TargetError(f"target {rel!r} was replaced while it was being copied")
                        for f in walk_fd(
                            tfd,
                            label=str(project / rel),
                            skip=skip,
                            max_files=policy.max_work_files,
                            max_bytes=policy.max_work_bytes,
                        ):
                            add(base + f.entry.rel, f.dir_fd, f.name, f.entry.kind, f.st)
                    finally:
                        os.close(tfd)
                else:
                    add(rel, dir_fd, name, kind_of(st.st_mode), st)
            finally:
                os.close(dir_fd)

    meta = root.meta(task_id)
    meta.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write(
        meta / "manifest.json",
        json.dumps(
            {"project": str(project), "targets": targets, "entries": [asdict(m) for m in prep.manifest]},
            indent=1,
        ),
    )
    fsutil.atomic_write(
        job / "TASK.md", task_md(task_id, task, targets, policy, effective, prep, task_md_extra)
    )
    return prep


def read_manifest(root: Root, task_id: str) -> dict:
    return json.loads((root.meta(task_id) / "manifest.json").read_text())


def task_md(
    task_id: str,
    task: Task,
    targets: list[str],
    policy: Policy,
    eff: Effective,
    prep: Prepared,
    extra: str = "",
) -> str:
    lim = eff.limits
    lines = [
        f"# Task {task_id}",
        "",
        task.prompt.strip() or "(no prompt: a mechanical change)",
        "",
        "## Context",
        "",
        f"- Engine: {task.engine}" + (f", model {task.model}" if task.model else ""),
        f"- Files to change are in `work/` ({prep.files} entries, {prep.bytes} bytes), copied "
        "from these targets of the project: " + ", ".join(f"`{t}`" for t in targets),
        "- `input/` is a read-only pristine copy; only what you change in `work/` is kept, as a "
        "diff that a person reviews before anything reaches the project.",
        f"- Limits: timeout {eff.timeout_ms / 1000:g} s, memory {lim.memory or policy.memory}, "
        f"cpus {lim.cpus or policy.cpus:g}, pids {lim.pids or policy.pids}, "
        f"network {policy.network}.",
    ]
    if task.command:
        lines.append(f"- Command: `{task.command}`")
    if task.check:
        lines.append(
            f"- Check: once you are done, `{task.check}` runs in `work/` (network none) and its result "
            "goes to the reviewer; run it yourself while you work."
        )
    if extra:
        lines += ["", extra.strip()]
    return "\n".join(lines) + "\n"

"""A task's targets as a runner or a reviewer lays them out again from the PostgreSQL queue
(docs/scale-out.md): the input manifest read and checked, and its files written under a
directory fila just made, every blob checked against its sha256 and size (run/remote_inputs.py
packs them on the submitting host).

Nothing read from the database is trusted: a path that leaves the directory, lands in fila's own
directories or under a symlink, names control characters, bidi overrides or what the file system
cannot encode, a manifest over the reader's policy limits (max_work_files, max_work_bytes:
checked before anything is written), or a blob whose bytes do not match, is refused. Every such
refusal is InvalidInput (or BlobMismatch), never another exception: a hostile manifest fails its
own task, not the runner that reads it. What the host fails at while writing (a full disk or
quota, an I/O error, a read-only file system, no file descriptors or memory left, a destination
it may not write) is not the task's: InfraError naming the path and the errno, so the task goes
back to the queue rather than failing for good (`unpack`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from pathlib import Path
from typing import Any, Protocol

from ...core.errors import InfraError, InvalidInput
from .errors import BlobMismatch

MANIFEST_VERSION = 1
# Top-level names a job root keeps for itself: no target may land there.
RESERVED = ("fila", "sandbox", "policies")
# Control characters and the bidi overrides/isolates that make a listed name read as another.
UNSAFE_CHARS = re.compile("[\x00-\x1f\x7f\u202a-\u202e\u2066-\u2069]")
# What a path's own shape makes the file system refuse (named twice, a file where a directory must
# be, too long, a name it cannot store): the task's. Any other errno while writing is the host's.
SHAPE_ERRNOS = frozenset(
    {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL, errno.EILSEQ}
)


class BlobSource(Protocol):
    def blob(self, sha256: str) -> bytes: ...


def _bad(msg: str) -> InvalidInput:
    return InvalidInput(f"the task's input manifest: {msg}", hint="submit the task again from its project")


def _safe_path(raw: Any) -> str:
    if not isinstance(raw, str) or not raw or "\x00" in raw or raw.startswith("/"):
        raise _bad(f"path {raw!r} is not a relative path")
    if UNSAFE_CHARS.search(raw):
        raise _bad(f"path {raw!r} holds a control character or a bidi override")
    try:
        os.fsencode(raw)
    except UnicodeError:
        raise _bad(f"path {raw!r} cannot be encoded as a file name on this host") from None
    parts = raw.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise _bad(f"path {raw!r} is not a plain relative path")
    if parts[0] in RESERVED:
        raise _bad(f"path {raw!r} lies in {parts[0]}/, which the runner keeps for itself")
    return raw


def read_manifest(data: bytes) -> tuple[list[str], list[dict[str, Any]]]:
    """(targets, entries) of a manifest, each checked; InvalidInput naming the first problem."""
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise _bad(f"not JSON ({e})") from None
    except RecursionError:
        raise _bad("nested too deeply to read") from None
    if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION:
        raise _bad(
            f"version {doc.get('version') if isinstance(doc, dict) else None!r}, not {MANIFEST_VERSION}"
        )
    targets, entries = doc.get("targets"), doc.get("entries")
    if not isinstance(targets, list) or not targets or not isinstance(entries, list):
        raise _bad("no targets or entries")
    for t in targets:
        if t != ".":
            _safe_path(t)
    links: set[str] = set()
    for e in entries:
        if not isinstance(e, dict) or e.get("kind") not in ("file", "symlink"):
            raise _bad(f"entry {e!r} is neither a file nor a symlink")
        _safe_path(e.get("path"))
        if not all(isinstance(e.get(k), t) for k, t in (("sha256", str), ("size", int), ("mode", int))):
            raise _bad(f"entry {e.get('path')!r} has no sha256, size or mode")
        if e["kind"] == "symlink":
            links.add(e["path"])
    for e in entries:
        parts = e["path"].split("/")
        under = next(
            ("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in links), None
        )
        if under is not None:
            raise _bad(f"path {e['path']!r} lies under the symlink {under!r}")
    return targets, entries


def check_limits(entries: list[dict[str, Any]], max_files: int, max_bytes: int) -> None:
    """InvalidInput when the manifest names more entries than `max_files` or more bytes in all
    than `max_bytes` (the reader's policy's max_work_files, max_work_bytes): checked on the
    manifest's own numbers, before any blob is fetched or any file written."""
    if len(entries) > max_files:
        raise _bad(f"{len(entries)} entries, over the policy's max_work_files {max_files}")
    total = sum(max(0, e["size"]) for e in entries)
    if total > max_bytes:
        raise _bad(f"{total} bytes in all, over the policy's max_work_bytes {max_bytes}")


def unpack(source: BlobSource, manifest: bytes, dest: Path, *, max_files: int, max_bytes: int) -> list[str]:
    """Lay the manifest's files out under `dest` (a directory fila just made), each blob checked
    against its sha256 and size; the targets to give the task. The manifest is refused first when
    it is over `max_files` / `max_bytes` (check_limits). Each distinct blob is fetched once. Files
    first, then symlinks, none followed: nothing is written outside `dest`. InvalidInput when a
    path's shape is refused (SHAPE_ERRNOS); InfraError when the host fails (any other errno, or
    no memory left): the host's, not the task's."""
    targets, entries = read_manifest(manifest)
    check_limits(entries, max_files, max_bytes)
    if "." in targets:  # the whole project: its top-level names, so the runner's own files stay out
        targets = sorted({e["path"].split("/")[0] for e in entries} | {t for t in targets if t != "."})
    fetched: dict[str, bytes] = {}  # at most max_bytes in all: each size was checked above
    try:
        for e in sorted(entries, key=lambda x: x["kind"] == "symlink"):
            data = fetched.get(e["sha256"])
            if data is None:
                data = fetched[e["sha256"]] = source.blob(e["sha256"])  # checked (BlobMismatch)
            if len(data) != e["size"]:
                raise BlobMismatch(
                    f"blob sha256 {e['sha256']} of {e['path']} holds {len(data)} bytes; "
                    f"the manifest says {e['size']}"
                )
            try:
                _write(dest, e, data)
            except OSError as err:
                if err.errno in SHAPE_ERRNOS:  # a path named twice, a file where a directory must be
                    raise _bad(f"path {e['path']!r} cannot be laid out: {err.strerror or err}") from None
                raise _host(dest / e["path"], err) from None
            except (ValueError, UnicodeError) as err:  # what the checks above missed: still the task's
                raise _bad(f"path {e['path']!r} cannot be laid out: {err}") from None
    except MemoryError:  # the host's, never the task's: its size was within the policy's limits
        raise InfraError(
            f"{dest}: this host ran out of memory while laying the task's targets out",
            hint="free memory on the runner's host; the task goes back to the queue",
        ) from None
    return targets


def _host(path: Path, err: OSError) -> InfraError:
    name = errno.errorcode.get(err.errno or 0, str(err.errno))
    return InfraError(
        f"{path} could not be written on this host ({name}: {err.strerror or err}): the host's "
        "failure, not the task's",
        hint="free space or descriptors, or fix the runner's --root; the task goes back to the queue",
    )


def _write(dest: Path, e: dict[str, Any], data: bytes) -> None:
    path = dest / e["path"]
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.realpath(path.parent) != os.path.join(os.path.realpath(dest), *e["path"].split("/")[:-1]):
        raise _bad(f"path {e['path']!r} does not stay inside the job's project")
    if e["kind"] == "symlink":
        if not data or b"\x00" in data:
            raise _bad(f"symlink {e['path']!r} has an empty target or one with a NUL byte")
        os.symlink(data, path)
        return
    mode = 0o755 if e["mode"] & 0o100 else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with contextlib.closing(os.fdopen(fd, "wb")) as f:
        f.write(data)
    os.chmod(path, mode)

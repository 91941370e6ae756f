"""A task's targets on their way to a runner of the PostgreSQL queue (docs/scale-out.md): packed
on the submitting host into content-addressed blobs and a manifest, and laid out again on the
runner that claims the task, every file checked against its sha256.

`pack` reads the targets exactly as a job directory is made (workspace/jobdir.prepare: the
policy's deny rules, max_work_files and max_work_bytes, no link followed out of the project), so
an upload over the policy's limits is refused with the limit's own error before anything is sent.
`unpack` and `read_manifest` (queue/pg/inputs.py, which a reviewer's `apply --queue` uses too)
trust nothing of what they read from the database.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass

from ..core import fsutil
from ..core.errors import InvalidInput, LimitExceeded
from ..core.layout import Root
from ..core.models import Task
from ..queue.pg.blobs import Blob
from ..queue.pg.inputs import MANIFEST_VERSION, RESERVED, BlobSource, read_manifest, unpack
from ..workspace import jobdir
from .intake import Checked, check_task, root_tags


@dataclass(frozen=True)
class Packed:
    """The targets as they travel: the manifest blob and the distinct contents it names."""

    manifest: Blob
    files: list[Blob]
    targets: list[str]
    bytes: int


def pack(root: Root, task: Task, checked: Checked | None = None) -> Packed:
    """The task's targets read from its project under `root`'s policy (check_task first, unless
    `checked` is its result already), as a manifest and the blobs it names;
    LimitExceeded/TargetError as a job directory's copy raises."""
    checked = checked or check_task(root, task, tags_of=root_tags(root))
    scratch = f"upload-{secrets.token_hex(8)}"
    pol = checked.policy
    try:
        try:
            prep = jobdir.prepare(root, scratch, checked.task, pol, checked.effective)
        except LimitExceeded as e:
            raise LimitExceeded(
                f"the targets ({', '.join(checked.targets)} in {checked.project}) are over policy "
                f"{task.policy!r}'s limits (max_work_files {pol.max_work_files}, max_work_bytes "
                f"{pol.max_work_bytes}): {e.message}; nothing was sent to the queue",
                hint="narrow the targets, or use a policy with larger limits",
            ) from None
        base = prep.job_dir / "input"
        contents: dict[str, Blob] = {}
        entries = []
        for m in prep.manifest:
            src = base / m.path
            data = os.fsencode(os.readlink(src)) if m.kind == "symlink" else src.read_bytes()
            if hashlib.sha256(data).hexdigest() != m.sha256:
                raise InvalidInput(f"target file {m.path} changed while it was read; submit again")
            contents.setdefault(m.sha256, Blob(m.path, data, m.sha256))
            entries.append(
                {"path": m.path, "kind": m.kind, "size": m.size, "sha256": m.sha256, "mode": m.mode}
            )
    finally:
        fsutil.remove_tree(root.job_dir(scratch))
        fsutil.remove_tree(root.meta(scratch))
    doc = {"version": MANIFEST_VERSION, "targets": checked.targets, "entries": entries}
    manifest = Blob.of("input.manifest", json.dumps(doc, indent=1, sort_keys=True).encode())
    files = [Blob("file", b.data, b.sha256) for b in contents.values()]
    return Packed(manifest, files, checked.targets, sum(len(b.data) for b in files))


__all__ = ["MANIFEST_VERSION", "RESERVED", "BlobSource", "Packed", "pack", "read_manifest", "unpack"]

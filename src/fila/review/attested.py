"""Provenance at the review gate (docs/provenance.md): whether a task's statements verify (shown
by `fila review`, checked by `fila verify`), apply's refusal of a task whose statements do not,
and the decision statement a person's apply or reject signs."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from ..core import fsutil
from ..core.errors import ApplyRefused, FilaError, InfraError, InvalidInput
from ..core.layout import Root, check_id
from ..core.models import Record, Status
from ..provenance import attest, keys
from ..provenance.predicate import Base, sha256
from ..provenance.sources import Source
from ..provenance.store import KINDS, Kind
from ..provenance.verify import Evidence, Verdict, verify


def evidence(source: Source, rec: Record, patch: bytes | None) -> Evidence:
    return Evidence(
        task_id=rec.id,
        run=source.statement(rec.id, "run"),
        trusted=source.trusted(),
        where=source.where,
        patch=patch,
        record=rec,
        decision=source.statement(rec.id, "decision"),
        inputs=source.inputs(rec.id),
    )


def verdict(source: Source, rec: Record, patch: bytes | None) -> Verdict:
    return verify(evidence(source, rec, patch))


def check_before_apply(source: Source, rec: Record, patch: bytes) -> bytes | None:
    """ApplyRefused, naming every mismatch, unless the task's run statement verifies (or the queue
    trusts no key and the task has no statement: provenance is off there). Returns the run
    statement's envelope as verified (what a commit's Fila-Provenance trailer names), or None."""
    ev = evidence(source, rec, patch)
    v = verify(ev)
    if not v.ok:
        raise ApplyRefused(
            "the task's provenance does not verify: " + "; ".join(v.problems),
            task_id=rec.id,
            hint=f"nothing was written; `fila verify {rec.id}` shows what the statements say; reject the "
            "task, or trust the signer's key (`fila keys trust`) when it is a runner you run",
        )
    return ev.run if v.state == "verified" else None


def sign_decision(root: Root, source: Source, rec: Record, *, project: Path | None = None,
                  merged: list[str] | None = None) -> str | None:  # fmt: skip
    """The decision statement of `rec` (just applied or rejected), signed with this root's key
    and stored where the queue keeps it; a line saying what was done, or None when there is
    nothing to sign (no run statement, no key: provenance is off here)."""
    if rec.status not in (Status.applied, Status.rejected) or not keys.has_signer(root):
        return None
    run = source.statement(rec.id, "run")
    if run is None:
        return None
    try:
        signer = keys.signer_of(root)
        base = None
        if rec.status == Status.applied:
            inputs = source.inputs(rec.id)
            base = Base(
                inputs_sha256=sha256(inputs) if inputs is not None else None,
                git_commit=attest.git_head(project) if project is not None else None,
                merged=list(merged or []),
            )
        data = attest.decision_envelope(rec, run, signer, base=base, host=attest.host_name())
        source.attest(rec.id, "decision", data)
    except (FilaError, OSError, ValueError) as e:
        return f"the decision was recorded, but its statement was not signed: {e}"
    return f"decision statement signed by key {signer.public_key.keyid[:16]}"


def beside_names(task_id: str) -> dict[Kind, str]:
    """The files `fila apply --attestations DIR` writes, by kind of statement."""
    return {kind: f"{check_id(task_id)}.{kind}.intoto.json" for kind in KINDS}


def check_beside(source: Source, task_id: str, dest: Path) -> None:
    """Before an apply with `--attestations DIR`: InvalidInput, nothing landed, when DIR is a
    symlink or not a directory (a missing one is made after the apply), or when the task has no
    run statement to write (provenance is off)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(dest)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise InvalidInput(f"--attestations {dest} is {what}", hint="name a directory (made if missing)")
    if source.statement(task_id, "run") is None:
        raise InvalidInput(
            f"task {task_id} has no run statement in {source.where} to write to {dest}",
            task_id=task_id,
            hint="provenance is off where it ran (`fila keys init` there); apply without --attestations",
        )


def write_beside(source: Source, task_id: str, dest: Path) -> list[Path]:
    """After an apply: the task's statements as the queue stores them (the run statement, and the
    decision statement when it was signed) written to `dest` (made when missing) under
    `beside_names`; the paths written. InfraError naming the directory when they cannot be: the
    apply stands."""
    written = []
    try:
        dest.mkdir(parents=True, exist_ok=True)
        check_beside(source, task_id, dest)  # made meanwhile as a symlink: refused too
        for kind, name in beside_names(task_id).items():
            data = source.statement(task_id, kind)
            if data is not None:
                fsutil.atomic_write(dest / name, data)
                written.append(dest / name)
    except (OSError, InvalidInput) as e:
        raise InfraError(
            f"task {task_id} was applied, but its statements were not written to {dest}: "
            + (e.message if isinstance(e, FilaError) else str(e)),
            task_id=task_id,
            hint=f"`fila verify {task_id} --export DIR` writes them from the queue",
        ) from None
    return written

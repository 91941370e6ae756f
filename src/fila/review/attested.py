"""Provenance at the review gate (docs/provenance.md): whether a task's statements verify (shown
by `fila review`, checked by `fila verify`), apply's refusal of a task whose statements do not,
and the decision statement a person's apply or reject signs."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ApplyRefused, FilaError
from ..core.layout import Root
from ..core.models import Record, Status
from ..provenance import attest, keys
from ..provenance.predicate import Base, sha256
from ..provenance.sources import Source
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

"""The statements fila signs (docs/provenance.md): the run statement when a task reaches review,
on the host that ran it, and the decision statement when a person applies or rejects it."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from securesystemslib.signer import Signer

from ..core.errors import FilaError
from ..core.layout import Root
from ..core.models import Policy, Record, Status
from . import envelope, keys, store
from .predicate import (
    DECISION_TYPE,
    RUN_TYPE,
    Base,
    DecisionPredicate,
    DigestRef,
    Runner,
    RunPredicate,
    facts,
    limits,
    sha256,
    statement,
)


def run_envelope(
    rec: Record,
    signer: Signer,
    *,
    patch: bytes,
    inputs: bytes | None,
    log: bytes | None,
    check_log: bytes | None,
    policy: Policy | None,
    host: str,
    queue: str,
) -> bytes:
    """The signed run statement of `rec` (a task in needs_review) and its DIFF.patch bytes."""
    if rec.status != Status.needs_review or rec.patch_sha256 is None:
        raise ValueError(f"task {rec.id} is {rec.status}: only a task in review has a run statement")
    started = rec.attempts[0].started_at if rec.attempts else None
    pred = RunPredicate(
        facts=facts(rec),
        limits=limits(policy, rec) if policy is not None else None,
        inputs_sha256=sha256(inputs) if inputs is not None else None,
        log_sha256=sha256(log) if log is not None else None,
        check_log_sha256=sha256(check_log) if check_log is not None else None,
        runner=Runner(host=host, queue="postgresql" if queue == "postgresql" else "file"),
        submitted_at=rec.submitted_at,
        started_at=started,
        finished_at=rec.updated_at,
    )
    return envelope.sign(statement(sha256(patch), RUN_TYPE, pred), signer)


def decision_envelope(rec: Record, run: bytes, signer: Signer, *, base: Base | None, host: str) -> bytes:
    """The signed decision on `rec` (applied or rejected), chained to its run statement `run`
    (the envelope's bytes) by the sha256 of that statement."""
    d = rec.decision
    if d is None or d.action not in ("applied", "rejected"):
        raise ValueError(f"task {rec.id} has no apply or reject to sign")
    env, stmt = envelope.read(run, where=f"task {rec.id}'s run statement")
    try:
        digest = stmt["subject"][0]["digest"]["sha256"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"task {rec.id}'s run statement names no DIFF.patch digest") from None
    if not isinstance(digest, str):
        raise ValueError(f"task {rec.id}'s run statement names no DIFF.patch digest")
    pred = DecisionPredicate(
        task_id=rec.id,
        action=d.action,
        by=d.by,
        at=d.at,
        reason=d.reason,
        run=DigestRef(sha256=sha256(env.payload)),
        base=base,
        host=host,
    )
    return envelope.sign(statement(digest, DECISION_TYPE, pred), signer)


def host_name() -> str:
    return socket.gethostname()


def on_review(root: Root, rec: Record, policy: Policy | None) -> Path | None:
    """The file queue: sign `rec`'s run statement with the root's key and store it beside the
    record; None when the root has no key (provenance is off there)."""
    if rec.status != Status.needs_review or not keys.has_signer(root) or rec.patch_path is None:
        return None
    signer = keys.signer_of(root)
    patch = (root.path / rec.patch_path).read_bytes()
    inputs = _bytes(root.meta(rec.id) / "manifest.json")
    log = _bytes(root.path / rec.log_path) if rec.log_path else None
    check_log = _bytes(root.path / rec.check.log_path) if rec.check and rec.check.log_path else None
    data = run_envelope(
        rec,
        signer,
        patch=patch,
        inputs=inputs,
        log=log,
        check_log=check_log,
        policy=policy,
        host=host_name(),
        queue="file",
    )
    return store.write(root, rec.id, "run", data)


def _bytes(path: Path) -> bytes | None:
    with contextlib.suppress(OSError):
        return path.read_bytes()
    return None


def git_head(project: Path) -> str | None:
    """The commit HEAD names in `project`'s .git, read as files (no git run in a project fila
    does not control); None when it is no plain git checkout."""
    git = project / ".git"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head if len(head) in (40, 64) else None
        ref = head[5:]
        if ".." in ref.split("/"):
            return None
        with contextlib.suppress(FileNotFoundError):
            return (git / ref).read_text().strip() or None
        for line in (git / "packed-refs").read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name == ref:
                return sha
    return None


def signing_error(e: FilaError) -> str:
    return f"provenance not signed: {e.message}"

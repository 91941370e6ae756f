"""Verifying a task's statements (docs/provenance.md, "What verify checks"): the signatures
against the trusted keys, DIFF.patch's bytes against the subject, the record against the run
statement, the task against the statement's task (no replay), the decision against the run it
chains to; and what all of it proves, for a person (`lines`) and for machines (`to_json`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError

from ..core.models import Record, Status
from . import envelope
from .keys import TrustedKey
from .predicate import (
    DECISION_TYPE,
    RUN_TYPE,
    STATEMENT_TYPE,
    SUBJECT,
    DecisionPredicate,
    RunPredicate,
    facts,
    sha256,
)

State = Literal["verified", "failed", "unsigned"]


@dataclass
class Evidence:
    """What one verification reads. `record` None: no queue at hand (`--patch`, `--attestation`);
    `inputs` None: the input manifest is not at hand."""

    task_id: str | None
    run: bytes | None
    trusted: list[TrustedKey]
    where: str
    patch: bytes | None = None
    record: Record | None = None
    decision: bytes | None = None
    inputs: bytes | None = None


@dataclass
class Verdict:
    task_id: str | None
    state: State
    problems: list[str] = field(default_factory=list)
    proves: list[str] = field(default_factory=list)
    run: RunPredicate | None = None
    decision: DecisionPredicate | None = None
    signers: dict[str, str] = field(default_factory=dict)  # kind -> keyid
    note: str | None = None  # why a task has nothing signed

    @property
    def ok(self) -> bool:
        return self.state != "failed"

    def summary(self) -> str:
        if self.state == "unsigned":
            return f"not signed ({self.note})"
        if self.state == "verified":
            return "verified" + (" (run and decision)" if self.decision else " (run)")
        return "FAILED: " + "; ".join(self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "state": self.state,
            "problems": self.problems,
            "proves": self.proves,
            "signed_by": self.signers,
            "note": self.note,
            "run": self.run.model_dump(mode="json") if self.run else None,
            "decision": self.decision.model_dump(mode="json") if self.decision else None,
        }


def verify(ev: Evidence) -> Verdict:
    """Every check that `ev` allows; a failed one adds its problem and the others still run, so
    the verdict names everything that does not match."""
    v = Verdict(ev.task_id, "verified")
    if ev.run is None:
        # A run that reached review closed its last attempt as a success; a failed one did not.
        never = ev.record is not None and not any(a.outcome == "success" for a in ev.record.attempts)
        if not ev.trusted or never:
            v.state = "unsigned"
            v.note = (
                "the task never reached review" if never else "no trusted key on this queue: `fila keys init`"
            )
            return v
        v.problems.append(
            f"no run statement for task {ev.task_id} in {ev.where} (keys are trusted there, "
            "so every task in review must have one)"
        )
        v.state = "failed"
        return v
    run = _statement(v, ev, ev.run, "run", RUN_TYPE, RunPredicate)
    assert run is None or isinstance(run, tuple)
    if run is not None:
        env, stmt, pred = run
        assert isinstance(pred, RunPredicate)
        v.run = pred
        subject = stmt["subject"][0]["digest"]["sha256"]
        _check_run(v, ev, pred, subject)
        if ev.decision is not None:
            dec = _statement(v, ev, ev.decision, "decision", DECISION_TYPE, DecisionPredicate)
            if dec is not None:
                _, dstmt, dpred = dec
                assert isinstance(dpred, DecisionPredicate)
                v.decision = dpred
                _check_decision(v, ev, env, subject, dstmt, dpred)
        elif ev.record is not None and ev.record.status in (Status.applied, Status.rejected):
            v.proves.append(f"decision: {ev.record.status} (no signed decision statement)")
    if v.problems:
        v.state = "failed"
    return v


def _statement(
    v: Verdict, ev: Evidence, raw: bytes, kind: str, ptype: str, model: type[BaseModel]
) -> tuple[Envelope, dict[str, Any], BaseModel] | None:
    """The envelope read, its signature checked against the trusted keys, its statement's shape
    checked; None (a problem added) when any of it fails."""
    try:
        env, stmt = envelope.read(raw, where=f"the {kind} statement")
    except envelope.BadEnvelope as e:
        v.problems.append(e.message)
        return None
    ids = sorted(env.signatures)
    known = [k for k in ev.trusted if k.keyid in env.signatures]
    if not known:
        v.problems.append(
            f"the {kind} statement is signed by key {', '.join(i[:16] for i in ids) or '(none)'}, "
            f"which is not trusted in {ev.where} (`fila keys trust`)"
        )
        return None
    try:
        accepted = env.verify([k.key for k in known], 1)
    except (VerificationError, ValueError):
        v.problems.append(
            f"the {kind} statement's signature does not verify with key {known[0].keyid[:16]} "
            f"({known[0].name}): the statement changed after it was signed"
        )
        return None
    keyid = next(iter(accepted))
    v.signers[kind] = keyid
    names = {k.keyid: k.name for k in known}
    subj = stmt.get("subject")
    if (
        stmt.get("_type") != STATEMENT_TYPE
        or stmt.get("predicateType") != ptype
        or not isinstance(subj, list)
        or len(subj) != 1
        or not isinstance(subj[0], dict)
        or subj[0].get("name") != SUBJECT
        or not isinstance(subj[0].get("digest"), dict)
        or not isinstance(subj[0]["digest"].get("sha256"), str)
    ):
        v.problems.append(f"the {kind} statement is not an in-toto Statement v1 of {ptype} about {SUBJECT}")
        return None
    try:
        pred = model.model_validate(stmt.get("predicate"))
    except ValidationError as e:
        v.problems.append(f"the {kind} statement's predicate does not validate: {e.errors()[0]['msg']}")
        return None
    v.proves.append(f"{kind} statement signed by key {keyid[:16]} ({names.get(keyid) or 'unnamed'})")
    return env, stmt, pred


def _check_run(v: Verdict, ev: Evidence, pred: RunPredicate, subject: str) -> None:
    f = pred.facts
    if ev.task_id is not None and f.task.id != ev.task_id:
        v.problems.append(
            f"the run statement is task {f.task.id}'s, not task {ev.task_id}'s (a statement "
            "replayed for another task)"
        )
    if f.result.patch_sha256 != subject:
        v.problems.append(
            f"the run statement's subject ({subject[:16]}) is not its result's patch "
            f"({(f.result.patch_sha256 or 'none')[:16]})"
        )
    if ev.patch is not None:
        got = sha256(ev.patch)
        if got != subject:
            v.problems.append(
                f"DIFF.patch hashes to sha256 {got[:16]}, not the signed subject's {subject[:16]}: "
                "the patch changed after signing"
            )
        else:
            v.proves.append(f"DIFF.patch is the signed one (sha256 {subject})")
    if ev.record is not None:
        try:
            now = facts(ev.record).model_dump(mode="json")
        except ValueError as e:
            v.problems.append(str(e))
            now = None
        if now is not None:
            signed = f.model_dump(mode="json")
            now["result"]["status"] = signed["result"]["status"]  # the decision moves it on
            changed = _differences(signed, now)
            if changed:
                v.problems.append(
                    f"task {ev.record.id}'s record does not match its run statement: "
                    + "; ".join(changed[:10])
                    + (" ..." if len(changed) > 10 else "")
                )
    if ev.inputs is not None and pred.inputs_sha256 is not None and sha256(ev.inputs) != pred.inputs_sha256:
        v.problems.append("the input manifest is not the one the run statement names (inputs_sha256)")
    v.proves.extend(run_lines(pred))


def _check_decision(
    v: Verdict, ev: Evidence, run_env: Envelope, subject: str, stmt: dict[str, Any], pred: DecisionPredicate
) -> None:
    if ev.task_id is not None and pred.task_id != ev.task_id:
        v.problems.append(f"the decision statement is task {pred.task_id}'s, not task {ev.task_id}'s")
    ran = sha256(run_env.payload)
    if pred.run.sha256 != ran:
        v.problems.append(
            f"the decision chains to run statement {pred.run.sha256[:16]}, not to this task's "
            f"run statement {ran[:16]}"
        )
    if stmt["subject"][0]["digest"]["sha256"] != subject:
        v.problems.append("the decision statement is about another DIFF.patch than the run statement")
    d = ev.record.decision if ev.record is not None else None
    if ev.record is not None and (d is None or (d.action, d.by, d.at) != (pred.action, pred.by, pred.at)):
        v.problems.append(
            f"task {ev.record.id}'s recorded decision does not match its decision statement "
            f"({pred.action} by {pred.by} at {pred.at})"
        )
    landed = ""
    if pred.base is not None and pred.base.git_commit:
        landed = f" onto commit {pred.base.git_commit[:12]}"
    v.proves.append(
        f"{pred.action} by {pred.by} at {pred.at}{landed} on host {pred.host}, chained to the run "
        f"statement {ran[:16]}"
    )


def run_lines(p: RunPredicate) -> list[str]:
    f = p.facts
    out = [
        f"task {f.task.id}: engine {f.task.engine}"
        + (f" model {f.task.model}" if f.task.model else "")
        + f", prompt sha256 {f.task.prompt_sha256[:16]}, targets {', '.join(f.task.targets)}"
    ]
    for a in f.attempts:
        img = f"{a.image.tag} {a.image.id or ''}".strip() if a.image else "no image"
        out.append(f"  engine {a.engine} ({img}): {a.outcome or '?'}, exit {a.exit_code}")
    if f.policy is not None:
        out.append(
            f"policy {f.policy.name} sha256 {f.policy.sha256[:16]}"
            + (
                f", network {p.limits.network}, memory {p.limits.memory}, cpus {p.limits.cpus}"
                if p.limits
                else ""
            )
        )
    if f.egress is not None:
        e = f.egress
        out.append(
            f"egress: {e.allowed} allowed, {e.denied} denied, {e.route_requests} model calls, "
            f"{e.input_tokens + e.output_tokens} tokens, {e.credentials_scrubbed} credentials scrubbed"
        )
    if f.check is not None:
        out.append(
            f"check `{f.check.command}`: exit {f.check.exit_code}" + (" (passed)" if f.check.passed else "")
        )
    out.append(
        f"ran on {p.runner.host} ({p.runner.queue} queue, {f.backend or '?'}) from {p.started_at} "
        f"to {p.finished_at}"
    )
    return out


def _differences(signed: Any, now: Any, where: str = "") -> list[str]:
    """The dotted fields whose values differ, with both values."""
    if isinstance(signed, dict) and isinstance(now, dict):
        out = []
        for k in sorted(signed.keys() | now.keys()):
            out += _differences(signed.get(k), now.get(k), f"{where}.{k}" if where else k)
        return out
    if isinstance(signed, list) and isinstance(now, list) and len(signed) == len(now):
        out = []
        for i, (a, b) in enumerate(zip(signed, now, strict=True)):
            out += _differences(a, b, f"{where}[{i}]")
        return out
    if signed != now:
        return [f"{where}: signed {_short(signed)}, now {_short(now)}"]
    return []


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."

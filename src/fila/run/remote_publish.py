"""What a runner of the PostgreSQL queue writes into the database at a claim's end (run/remote.py,
docs/scale-out.md): the outcome of the run path with the blobs a reviewer needs, in one publish
that a stale token cannot make; a hand back when the run path handed the task back before its
container started; a refusal when the task's targets did not arrive intact.

Every string it writes there goes through one redaction (`Redact`): the runner's root and the job
root (`<root>/remote/<id>.<token>`) are local to this host, gone after the publish, and not for
every reader of the database to learn. DIFF.patch and the log are published as the job wrote them
(their sha256 is what a reviewer checks)."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from ..core.errors import FilaError, Refused
from ..core.layout import Root
from ..core.models import ErrorInfo, ErrorKind, Record, Status
from ..queue import breaker
from ..queue.pg.blobs import Blob
from ..queue.pg.records import RESULT_FIELDS, on_db_clock
from ..queue.pg.store import INPUTS, OUTCOMES, Lease, PgQueue
from ..queue.retry import INFRA
from ..recovery.runner_root import JOBS

if TYPE_CHECKING:
    from securesystemslib.signer import Signer

M = TypeVar("M", bound=BaseModel)


class Redact:
    """The job root `jr` of task `tid`, and the runner's root above it (runner_root.jobs_dir:
    `<root>/remote/<id>.<token>`), in any string this runner publishes: the task's log by the
    command that shows the published one (`fila logs ID --queue URL`: never the URL, which may
    carry credentials, and a reader has their own), the job root by `<job>`, the runner's root by
    `<runner>` (only when the job root is where a runner makes it: no other directory is taken
    for a runner's root). This host's other known places too, which an error may name (an
    EngineUnavailable's `path=`): the user's runtime directory ($XDG_RUNTIME_DIR, Podman's
    /tmp/podman-run-UID, a CONTAINER_HOST socket's directory) by `<runtime>`, $HOME by `<home>`.
    Each path as given and as its realpath, raw and as JSON escapes it (the events blob's lines),
    longest first, matched only as a whole path: where its last name ends (`.../g.1` is not
    `.../g.10`) and not inside a longer name (`/home/u` is not in `/srv/home/u`)."""

    JOB, RUNNER, RUNTIME, HOME = "<job>", "<runner>", "<runtime>", "<home>"

    def __init__(self, jr: Root, tid: str) -> None:
        words: dict[str, str] = {}
        for path, word in (
            (jr.log_path(tid), f"`fila logs {tid} --queue URL`"),
            (jr.path, self.JOB),
            *([(jr.path.parent.parent, self.RUNNER)] if jr.path.parent.name == JOBS else []),
            *((p, self.RUNTIME) for p in _runtime_dirs()),
            *([(home, self.HOME)] if os.path.isabs(home := os.environ.get("HOME", "")) else []),
        ):
            for p in (str(path), os.path.realpath(path)):
                if len(p.rstrip("/")) <= 1:  # a root of "/" names nothing of its own
                    continue
                p = p.rstrip("/")
                for form in (p, json.dumps(p)[1:-1]):
                    words.setdefault(form, word)
        self.words = words
        needles = sorted(words, key=len, reverse=True)  # the longest first: the log before its job root
        self.where = re.compile(
            r"(?<![\w.-])(?:" + "|".join(re.escape(n) for n in needles) + r")(?![\w-]|\.\w)"
        )

    def text(self, s: str) -> str:
        """`s` with the paths replaced; `s` itself when it names none."""
        out = self.where.sub(lambda m: self.words[m.group(0)], s)
        return s if out == s else out

    def model(self, m: M) -> M:
        """`m` with every string in it redacted, however deep (fields, lists, dicts' keys and
        values, a model's extra fields); `m` itself when none changes. Enums are kept."""
        return self._value(m)

    def _value(self, v: Any) -> Any:
        if isinstance(v, Enum):
            return v
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, BaseModel):
            changes = {}
            for name in [*type(v).model_fields, *(v.model_extra or {})]:
                old = getattr(v, name)
                new = self._value(old)
                if new is not old:
                    changes[name] = new
            return v.model_copy(update=changes) if changes else v
        if isinstance(v, list | tuple):
            items = [self._value(x) for x in v]
            return type(v)(items) if any(a is not b for a, b in zip(items, v, strict=True)) else v
        if isinstance(v, dict):
            pairs = [(self._value(k), self._value(x)) for k, x in v.items()]
            changed = any(a is not k or b is not x for (a, b), (k, x) in zip(pairs, v.items(), strict=True))
            return dict(pairs) if changed else v
        return v

    def jsonl(self, data: bytes) -> bytes:
        """A JSON lines blob (the job's events) with the paths replaced in its text, as JSON
        writes them; a line that names none is kept byte for byte."""
        text = data.decode("utf-8", errors="surrogateescape")
        out = self.text(text)
        return data if out is text else out.encode("utf-8", errors="surrogateescape")


def _runtime_dirs() -> list[str]:
    """This user's runtime directories as the container engines find them (Podman's rule for
    its socket, sandbox/podman/service.py): $XDG_RUNTIME_DIR, /tmp/podman-run-UID, and the
    directory of a unix socket named by $CONTAINER_HOST or $DOCKER_HOST."""
    out = [d for d in (os.environ.get("XDG_RUNTIME_DIR"), f"/tmp/podman-run-{os.getuid()}") if d]
    for var in ("CONTAINER_HOST", "DOCKER_HOST"):
        host = os.environ.get(var, "")
        if host.startswith("unix://"):
            out.append(os.path.dirname(host.removeprefix("unix://")))
    return [d for d in out if os.path.isabs(d)]  # "" would be the working directory's realpath


def refuse(
    q: PgQueue, lease: Lease, jr: Root, backend: str, msg: str, *, limit: int | None = None
) -> Record | None:
    """A task this runner refuses before any container (its targets do not arrive intact), from
    job root `jr`: its reason redacted (`Redact`), then cut to `limit` characters (cut after
    redacting: a path cut first is no whole path, and its beginning would be published)."""
    text = Redact(jr, lease.task_id).text(msg)
    if limit is not None and len(text) > limit:
        text = text[:limit] + " [cut]"
    error = ErrorInfo(kind=ErrorKind.invalid, message=text)
    try:
        return q.publish(lease.task_id, lease.token, Status.failed, {"error": error, "backend": backend})
    except Refused:  # its record changed outside fila meanwhile: a person's to decide, nothing published
        return None


def hand_back(
    q: PgQueue, lease: Lease, jr: Root, error: ErrorInfo | None, *, counted: bool, backoff_s: float
) -> Record | None:
    """The task back to the queue before its container started (PgQueue.hand_back), from job root
    `jr`: its error redacted (`Redact`; a FilaError's text names its `path=`). A hand back that
    gives up fails the task, counted against its policy's threshold as a published failure is."""
    if error is not None:
        error = Redact(jr, lease.task_id).model(error)
    limit = breaker.threshold(jr, lease.task.policy)
    return q.hand_back(
        lease.task_id, lease.token, error, counted=counted, backoff_s=backoff_s, threshold=limit
    )


def give_back(q: PgQueue, lease: Lease, jr: Root, message: str) -> None:
    """The host's failure before the container (its disk, its engine, what it lacks): the task
    back to the queue uncounted and at once, its tries not this host's to spend. A database that
    does not answer leaves it to the lease (its sweep requeues it)."""
    with contextlib.suppress(FilaError):
        hand_back(
            q, lease, jr, ErrorInfo(kind=ErrorKind.infra, message=message), counted=False, backoff_s=0.0
        )


def publish(
    q: PgQueue,
    lease: Lease,
    jr: Root,
    manifest: bytes,
    rec: Record,
    progress: Callable[[str], None],
    *,
    signer: Signer | None = None,
) -> Record | None:
    """The local record `rec` of job root `jr` published under the lease's token (None: the
    lease was lost first, nothing written), or handed back when the run path left it queued.
    Every string of the record and the events blob's text are redacted (`Redact`). A task in
    review gets its run statement, signed by `signer` (the runner host's key) over the redacted
    record, as the blob `provenance.run.json` in the same publish (docs/provenance.md)."""
    tid = lease.task_id
    redact = Redact(jr, tid)
    if rec.status == Status.queued:  # handed back before its container started
        counted = rec.error is not None and rec.error.kind == ErrorKind.infra
        hand_back(q, lease, jr, rec.error, counted=counted, backoff_s=INFRA.backoff(1) if counted else 0.0)
        return None
    if rec.status not in OUTCOMES:
        raise AssertionError(f"task {tid}: the run path ended {rec.status}")
    rec = redact.model(rec)
    blobs = [Blob.of(INPUTS, manifest)]
    fields = {k: getattr(rec, k) for k in RESULT_FIELDS if getattr(rec, k, None) is not None}
    for name, rel, key in (
        ("DIFF.patch", rec.patch_path, "patch_path"),
        ("log", rec.log_path, "log_path"),
    ):
        path = jr.path / rel if rel else None
        if path is not None and path.is_file():
            blobs.append(Blob.of(name, path.read_bytes()))
            fields[key] = name
        else:
            fields.pop(key, None)
    if jr.events_path(tid).is_file():
        blobs.append(Blob.of("events.jsonl", redact.jsonl(jr.events_path(tid).read_bytes())))
    if signer is not None and rec.status == Status.needs_review:
        try:
            blobs.append(_run_statement(jr, rec, signer, blobs, host=lease.runner))
        except (FilaError, OSError, ValueError) as e:
            progress(f"{tid}: provenance not signed: {e}")
    ran = [
        a.model_copy(
            update={"log_path": "log" if i == len(rec.attempts) - 1 and "log_path" in fields else None}
        )
        for i, a in enumerate(rec.attempts)
    ]
    # This host's clock may be off (the lease never depends on it); the record's times are
    # the database's, so the attempts' are moved onto its clock as measured at the claim.
    ran = on_db_clock(ran, lease.clock_offset_s)
    limit = breaker.threshold(jr, lease.task.policy)  # the count's, should this be a failure
    out = q.publish(tid, lease.token, rec.status, fields, blobs, ran=ran, threshold=limit)
    if out is None:
        progress(f"{tid}: the lease was lost before the publish; the result is discarded")
    return out


def _run_statement(jr: Root, rec: Record, signer: Signer, blobs: list[Blob], *, host: str) -> Blob:
    """The run statement of `rec` (redacted) over the blobs about to be published. One that
    cannot be made (ValueError, FilaError, OSError) leaves the task in review without it, and
    verification names it missing."""
    from ..provenance import attest, store
    from ..queue.policy import load_policy

    named = {b.name: b.data for b in blobs}
    if "DIFF.patch" not in named:
        raise ValueError("the job left no DIFF.patch to sign")
    policy = None
    with contextlib.suppress(FilaError, OSError):
        pol, ref = load_policy(jr, rec.policy.name) if rec.policy else (None, None)
        policy = pol if ref is not None and ref.sha256 == rec.policy.sha256 else None
    check_log = None
    if rec.check is not None and rec.check.log_path:
        with contextlib.suppress(OSError):
            check_log = (jr.path / rec.check.log_path).read_bytes()
    data = attest.run_envelope(rec, signer, patch=named["DIFF.patch"], inputs=named.get(INPUTS),
                               log=named.get("log"), check_log=check_log, policy=policy, host=host,
                               queue="postgresql")  # fmt: skip
    return Blob.of(store.blob_name("run"), data)

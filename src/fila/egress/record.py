"""`network: allowlist` after the job: what the gateway logged and counted (egress.jsonl,
summary.json) read into the record's `egress` section, and that section as text for `fila show`,
`fila review` and REVIEW.html (docs/architecture.md, "Threat model in brief"). Everything here was
written by the gateway, which the engine talked to: read capped, without following a link, and
shown escaped."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Collection
from pathlib import Path

from ..core.models import EgressRecord, EgressRequest, RouteSummary

MAX_LOG_BYTES = 8 << 20  # egress.jsonl read into the record at most this much
MAX_RECORD_REQUESTS = 500  # requests kept in the record; the rest are counted as dropped


def _read_gateway_file(path: Path, cap: int) -> bytes | None:
    """A file the gateway wrote: opened without following a link, a regular file, at most cap + 1
    bytes. b"" when absent, None when unusable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return b"" if e.errno == errno.ENOENT else None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(cap + 1)


def read_log(
    path: Path,
    *,
    cap: int = MAX_LOG_BYTES,
    keep: int = MAX_RECORD_REQUESTS,
    summary: Path | None = None,
    routes: Collection[str] | None = None,
) -> EgressRecord:
    """egress.jsonl as the record's `egress` section, read up to `cap` bytes. A route call has two
    lines with the same id (in flight, then final): the final one replaces the first; one left in
    flight means the gateway stopped during the call. `summary` (the gateway's summary.json) gives
    the totals when present, so they do not depend on how much of the log was kept. `routes`: the
    configured route names; per-route totals are kept for these only (a name the engine made up is
    a denied request, never a route)."""
    rec = EgressRecord()
    data = _read_gateway_file(path, cap)
    if data is None:
        rec.dropped = 1
        return rec
    lines = data.split(b"\n")
    if len(data) > cap:
        lines = lines[:-1]
        rec.dropped += 1
    items: list[EgressRequest] = []
    pending: dict[str, int] = {}  # id -> index in items of its in-flight line
    for raw in lines:
        if not raw.strip():
            continue
        try:
            item = EgressRequest.model_validate(json.loads(raw))
        except (ValueError, TypeError):
            rec.dropped += 1
            continue
        if item.id is not None and item.id in pending:
            items[pending.pop(item.id)] = item
        else:
            if item.id is not None and item.status is None and item.reason == "in flight":
                pending[item.id] = len(items)
            items.append(item)
    rec.in_flight = len(pending)
    learned: dict[str, None] = {}
    for item in items:
        if item.learned and item.allowed and item.door == "proxy" and item.host and item.port:
            learned[f"{item.host}:{item.port}"] = None
        _count(rec, item)
        if len(rec.requests) < keep:
            rec.requests.append(item)
        else:
            rec.dropped += 1
    rec.learned = list(learned)
    if summary is not None:
        _apply_summary(rec, summary)
    if routes is not None:
        rec.routes = {k: v for k, v in rec.routes.items() if k in routes}
    return rec


def _apply_summary(rec: EgressRecord, path: Path) -> None:
    """The gateway's own totals (counted as it decided, also past its log cap) replace those
    counted from the log; what the log left out is counted as dropped."""
    data = _read_gateway_file(path, 1 << 20)
    if not data:
        return
    try:
        doc = json.loads(data)
        routes = {str(k): RouteSummary.model_validate(v) for k, v in (doc.get("routes") or {}).items()}
        allowed, denied = int(doc["allowed"]), int(doc["denied"])
        suppressed = sum(int(v) for v in (doc.get("suppressed") or {}).values())
        in_flight = int(doc.get("in_flight") or 0)
    except (ValueError, TypeError, KeyError, AttributeError):
        rec.dropped += 1
        return
    # The gateway rewrites summary.json at most every half second for non-route lines, and fila
    # reads it while the gateway still runs: a denial logged just now may not be in it yet. Both
    # counts are lower bounds of the truth (the log's without its in-flight lines, which the
    # summary counts only once final), so the larger one is kept.
    rec.routes = routes
    rec.allowed = max(allowed, rec.allowed - rec.in_flight)
    rec.denied = max(denied, rec.denied)
    rec.dropped += suppressed
    rec.in_flight = max(rec.in_flight, in_flight)
    if isinstance(b := doc.get("budget_exhausted"), str) and rec.budget_exhausted is None:
        rec.budget_exhausted = b
    rec.learning = rec.learning or doc.get("learning") is True


def _count(rec: EgressRecord, item: EgressRequest) -> None:
    if item.allowed:
        rec.allowed += 1
    else:
        rec.denied += 1
    if item.budget and rec.budget_exhausted is None:
        rec.budget_exhausted = item.budget
    if item.route and not (not item.allowed and item.reason == "unknown route"):
        s = rec.routes.setdefault(item.route, RouteSummary())
        s.requests += 1
        key = str(item.status) if item.status is not None else "no answer" if item.allowed else "denied"
        if item.status is None and item.reason == "in flight":
            key = "in flight"  # the gateway stopped during the call
        s.statuses[key] = s.statuses.get(key, 0) + 1
        if item.usage:
            s.input_tokens += int(item.usage.get("input_tokens", 0) or 0)
            s.output_tokens += int(item.usage.get("output_tokens", 0) or 0)
        for kind, n in (item.scrubbed or {}).items():
            s.scrubbed[kind] = s.scrubbed.get(kind, 0) + int(n)


def scrub_messages(rec: EgressRecord | None) -> list[str]:
    """A warning per route whose upstream sent the injected credential back: the engine never saw
    it (the gateway replaced it, or refused the answer), but that upstream reflects credentials."""
    from ..core.text import inert

    out = []
    for name, s in sorted((rec.routes if rec else {}).items()):
        echoed = sum(n for k, n in s.scrubbed.items() if not k.startswith("refused"))
        refused = sum(n for k, n in s.scrubbed.items() if k.startswith("refused"))
        if echoed:
            kinds = ", ".join(
                f"{k} {n}" for k, n in sorted(s.scrubbed.items()) if not k.startswith("refused")
            )
            out.append(
                f"the upstream of route {inert(name)} echoed the injected credential {echoed} times "
                f"({inert(kinds)}); it was replaced before the engine saw it"
            )
        if refused:
            out.append(
                f"the upstream of route {inert(name)} sent {refused} compressed answers although the "
                "gateway asked for none; they were refused (the engine got 502) as they could hide the "
                "credential"
            )
    return out


def learned_text(rec: EgressRecord, nothing: str = "nothing") -> str:
    """What a learning run learned, for the record, show, review and REVIEW.html: the host:port
    list, and when log lines were dropped (a flood past the gateway's log cap, the record's read
    cap) that the list may be incomplete; never `nothing` for a log that was not read whole."""
    text = ", ".join(rec.learned)
    if rec.dropped:
        lost = f"incomplete: {rec.dropped} log lines dropped"
        return f"{text} ({lost})" if text else lost
    return text or nothing


def learning_messages(rec: EgressRecord | None) -> list[str]:
    """A warning when the job's policy was learning (egress.learn): its allowlist was not enforced
    for public hosts on the usual ports; what it let through is listed, for `fila policy suggest`."""
    from ..core.text import inert

    if rec is None or not rec.learning:
        return []
    what = learned_text(rec, "nothing beyond the allowlist")
    return [
        inert(
            f"the policy was learning: unlisted public hosts were let through the gateway; learned: {what} "
            "(fila policy suggest ID proposes the allowlist)"
        )
    ]


def budget_message(rec: EgressRecord | None) -> str | None:
    if rec is None or rec.budget_exhausted is None:
        return None
    return (
        f"the egress budget {rec.budget_exhausted} ended the run: the gateway answered 429 "
        "to the engine's model requests past it"
    )


def lines(rec: EgressRecord | None) -> list[str]:
    """The egress section as text lines (show, review, REVIEW.html); engine-chosen text escaped."""
    from ..core.text import inert

    if rec is None:
        return []
    out = [
        f"egress    {rec.allowed} allowed, {rec.denied} denied"
        + (f", {rec.dropped} dropped" if rec.dropped else "")
    ]
    if rec.learning:
        learned = learned_text(rec)
        out.append(
            inert(f"learning  the policy was learning: unlisted hosts were let through; learned: {learned}")
        )
    if rec.budget_exhausted:
        out.append(f"budget    {inert(rec.budget_exhausted)} exhausted: it ended the run")
    if rec.in_flight:
        out.append(
            f"unfinished {rec.in_flight} route calls were in flight when the gateway stopped: they may be "
            "unmetered (the upstream may have billed them)"
        )
    for name, s in sorted(rec.routes.items()):
        st = ", ".join(f"{k}: {v}" for k, v in sorted(s.statuses.items()))
        sc = ", ".join(f"{k}: {v}" for k, v in sorted(s.scrubbed.items()))
        out.append(
            f"route     {inert(name)}: {s.requests} requests ({st}), "
            f"{s.input_tokens} input / {s.output_tokens} output tokens"
            + (f"; credential scrubbed ({inert(sc)})" if sc else "")
        )
    for r in rec.requests:
        where = f"/{r.route}{r.path or ''}" if r.route else f"{r.host}:{r.port}"
        verdict = ("LEARNED" if r.learned else "allowed") if r.allowed else f"DENIED ({r.reason})"
        size = f" in {r.bytes_in or 0} B out {r.bytes_out or 0} B" if r.allowed else ""
        out.append(
            inert(f"  {r.door or '?'} {r.method or '-'} {where} {r.status if r.status is not None else '-'} "
                  f"{verdict}{size}")
        )  # fmt: skip
    return out

"""The record: one JSON line per decision in egress.jsonl, up to LOG_CAP, and summary.json's totals
(`Recorder`, a part of the addon), and the marker files the host waits for.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import LOG_CAP, LOG_DIR, LOG_FIELD
from .meter import Meter

if TYPE_CHECKING:
    from mitmproxy import http


def new_totals() -> dict[str, Any]:
    return {"allowed": 0, "denied": 0, "routes": {}, "budget_exhausted": None, "suppressed": {}}


def mark(path: Path) -> None:
    """A marker file for the host (`listening`, `ready`), written whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(_now() + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------- the addon


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def escaped(text: str) -> str:
    """Engine-chosen text for the log, cut to LOG_FIELD: anything but printable ASCII escaped."""
    text = text[: LOG_FIELD + 1]
    return "".join(c if c.isascii() and c.isprintable() else ascii(c)[1:-1] for c in text)


class Recorder:
    """A part of the addon (fila_gateway.Gateway): its methods use the addon's state."""

    # -- the log

    def write(self, **fields: Any) -> None:
        line = {
            "t": _now(),
            "id": None,
            "door": "proxy",
            "method": None,
            "host": None,
            "port": None,
            "route": None,
            "path": None,
            "allowed": False,
            "reason": None,
            "status": None,
            "bytes_in": 0,
            "bytes_out": 0,
            "usage": None,
            "budget": None,
            "scrubbed": None,
        }
        line.update(fields)
        if not line.get("learned"):
            line.pop("learned", None)  # only a learned line carries the field (`learned: true`)
        for k in ("host", "path", "reason", "route", "method"):
            if isinstance(line[k], str):
                # What a line quotes (an upstream's unreadable answer, a malformed head) is scrubbed
                # of the route credentials before it is escaped and cut.
                text = escaped(self.needles.scrub_text(line[k], "log", {}))
                line[k] = text[:LOG_FIELD] + "..." if len(text) > LOG_FIELD else text
        final = line["reason"] != "in flight"
        if final:
            self.totals["allowed" if line["allowed"] else "denied"] += 1
            if line["budget"] and self.totals["budget_exhausted"] is None:
                self.totals["budget_exhausted"] = line["budget"]
        if self._log is None:
            return
        text = json.dumps(line) + "\n"
        # Past the cap only route calls (their usage is the record's) and learned requests (what
        # `fila policy suggest` proposes) are still written, up to a last margin: both are bounded
        # by max_requests. Everything else is counted per kind in summary.json.
        # An in-flight line never takes that margin: past the cap, the final line is the one kept.
        kept = final and line["allowed"] and (line["door"] == "route" or line.get("learned"))
        room = LOG_CAP + LOG_CAP // 4 if kept else LOG_CAP
        if self._log_bytes + len(text) > room:
            if not final:  # its final line is the one counted
                return
            kind = f"{line['door']} {'allowed' if line['allowed'] else 'denied'}: {line['reason']}"
            sup = self.totals["suppressed"]
            if kind in sup or len(sup) < 100:
                sup[kind] = sup.get(kind, 0) + 1
            else:
                sup["other"] = sup.get("other", 0) + 1
            self._summarize()
            return
        self._log.write(text)
        self._log_bytes += len(text)

    def _summarize(self, *, force: bool = False) -> None:
        """summary.json: the totals (per route usage included), rewritten atomically, so that the
        record's totals never depend on how much of the log was kept. Denials rewrite it at most
        every half second (a flood must not turn into a write storm); route calls every time."""
        now = time.monotonic()
        if self._log is None or (not force and now - self._summary_at < 0.5):
            return
        self._summary_at = now
        doc = {**self.totals, "requests": self.requests, "tokens": self.tokens, "in_flight": self.in_flight}
        doc["learning"] = bool(self.config and self.config.get("learn"))
        with contextlib.suppress(OSError):
            tmp = LOG_DIR / ".summary.tmp"
            tmp.write_text(json.dumps(doc))
            tmp.replace(LOG_DIR / "summary.json")

    def record(self, flow: http.HTTPFlow, *, allowed: bool, reason: str | None, status: int | None) -> None:
        """The one final line for an HTTP flow (each flow is logged once)."""
        if flow.metadata.get("fila_logged"):
            return
        flow.metadata["fila_logged"] = True
        m = flow.metadata
        meter: Meter | None = m.get("fila_meter")
        usage = meter.usage() if meter else None
        budget_key = m.get("fila_budget")
        limit = self.config["budget"]["max_tokens"] if self.config else None
        if m.get("fila_metered") and allowed and status is not None and 200 <= status < 300 and not usage:
            # A model call that answered without a usage report the gateway can read (a stream
            # without its usage event, a body past MAX_BODY_SCAN): unknown cost. Under a token
            # budget it spends the rest of the budget rather than counting as free.
            reason = "no readable usage in the response"
            if limit is not None:
                self.tokens = max(self.tokens, limit)
                budget_key = "max_tokens"
                reason += ": counted as the whole token budget"
        elif usage:
            self.tokens += usage["input_tokens"] + usage["output_tokens"]
        was_in_flight = m.pop("fila_in_flight", False)
        if was_in_flight:
            self.in_flight -= 1
        scrubbed = dict(m.get("fila_scrubbed") or {}) or None
        self.write(
            id=flow.id if was_in_flight else None,
            door=m.get("fila_door", "proxy"),
            method=flow.request.method,
            host=m.get("fila_host", flow.request.pretty_host),
            port=m.get("fila_port", flow.request.port),
            route=m.get("fila_route"),
            path=m.get("fila_path"),
            allowed=allowed,
            reason=reason,
            status=status,
            bytes_in=meter.bytes if meter else len(flow.response.raw_content or b"") if flow.response else 0,
            bytes_out=_sent_upstream(flow) if allowed else 0,
            usage=usage,
            budget=budget_key,
            scrubbed=scrubbed,
            learned=bool(m.get("fila_learned")),
        )
        # Only a configured route has totals (fila_route is set once the name is found).
        if route := m.get("fila_route") if m.get("fila_door") == "route" else None:
            r = self.totals["routes"].setdefault(
                route,
                {"requests": 0, "statuses": {}, "input_tokens": 0, "output_tokens": 0, "scrubbed": {}},
            )
            r["requests"] += 1
            for kind, n in (scrubbed or {}).items():
                r["scrubbed"][kind] = r["scrubbed"].get(kind, 0) + n
            key = str(status) if status is not None else "no answer" if allowed else "denied"
            r["statuses"][key] = r["statuses"].get(key, 0) + 1
            if usage:
                r["input_tokens"] += usage["input_tokens"]
                r["output_tokens"] += usage["output_tokens"]
            self._summarize(force=True)
        else:
            self._summarize()
        if m.pop("fila_slot", False) and self._slot is not None:
            self._slot.release()


def _sent_upstream(flow: Any) -> int:
    """wire.sent_upstream, imported on use: this module is tested without mitmproxy."""
    from .wire import sent_upstream

    return sent_upstream(flow)

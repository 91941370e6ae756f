"""Usage read from model-call answers (`Meter`, streamed or whole) and the refusal of an answer past
the budget (`Refusal`).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from .config import MAX_BODY_SCAN, MAX_SSE_LINE
from .jsonvalues import json_values

# ---------------------------------------------------------------- usage metering


def _usage_of(obj: Any) -> dict[str, Any] | None:
    """The usage object in one API response body or stream event, any of the supported APIs."""
    if not isinstance(obj, dict):
        return None
    typ = obj.get("type")
    if typ == "message_start" and isinstance(obj.get("message"), dict):
        return obj["message"].get("usage")  # Anthropic stream start: input tokens
    if isinstance(typ, str) and typ.startswith("response.") and isinstance(obj.get("response"), dict):
        return obj["response"].get("usage")  # OpenAI Responses: response.completed
    if isinstance(obj.get("usageMetadata"), dict):
        return obj["usageMetadata"]  # Gemini
    if isinstance(obj.get("usage"), dict):
        return obj["usage"]  # Anthropic body / message_delta, OpenAI body / final chunk
    return None


def normalize_usage(raw: dict[str, Any]) -> dict[str, int] | None:
    """{"input_tokens", "output_tokens"} from the fields each API uses. Anthropic's cache reads and
    writes count as input (they are billed as input)."""

    def n(*keys: str) -> int:
        # A negative or non-integer count is no usage report (it would credit the budget back).
        return sum(v for k in keys if isinstance(v := raw.get(k), int) and not isinstance(v, bool) and v >= 0)

    if not raw:
        return None
    return {
        "input_tokens": n(
            "input_tokens", "prompt_tokens", "promptTokenCount",
            "cache_creation_input_tokens", "cache_read_input_tokens",
        ),
        "output_tokens": n(
            "output_tokens", "completion_tokens", "candidatesTokenCount", "thoughtsTokenCount"
        ),
    }  # fmt: skip


class Meter:
    """Watches one response go by: counts bytes and collects usage, streamed or not."""

    def __init__(self, content_type: str, *, usage: bool = True) -> None:
        ctype = content_type.lower().split(";", 1)[0].strip()
        self.sse = usage and ctype == "text/event-stream"
        self.bytes = 0
        self.raw_usage: dict[str, Any] = {}
        self._pending = b""
        # Only a route's JSON reply is kept (bounded) to read its usage; proxied bodies are counted.
        # Usage is read only from a JSON, JSON lines or SSE reply of a model call (the caller's `usage`).
        kept = usage and ctype in ("application/json", "application/x-ndjson", "application/jsonl")
        self._body: bytearray | None = bytearray() if kept else None
        self.overflow = False

    def __call__(self, chunk: bytes) -> bytes:
        # Called by mitmproxy for every chunk of a streamed response, and once with b"" at its end.
        self.bytes += len(chunk)
        if self.sse:
            self._pending += chunk
            *lines, self._pending = self._pending.split(b"\n")
            for line in lines:
                self._line(line)
            if len(self._pending) > MAX_SSE_LINE:
                self._pending = b""  # no API sends such a line; do not hold on to it
            if not chunk and self._pending:
                self._line(self._pending)
                self._pending = b""
        elif self._body is not None:
            if len(self._body) + len(chunk) > MAX_BODY_SCAN:
                self._body = None
                self.overflow = True
            else:
                self._body += chunk
        return chunk

    def _line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line.startswith(b"data:"):
            return
        with contextlib.suppress(ValueError):
            self._add(json.loads(line[5:].strip() or b"null"))

    def _add(self, obj: Any) -> None:
        usage = _usage_of(obj)
        if isinstance(usage, dict):
            self.raw_usage.update({k: v for k, v in usage.items() if v is not None})

    def usage(self) -> dict[str, int] | None:
        if self._body:
            # One JSON document, JSON lines, or a JSON array of chunks (Gemini's streamGenerateContent
            # without alt=sse): each value in turn, so the last usage report counts.
            with contextlib.suppress(UnicodeDecodeError):
                for _, _, value in json_values(bytes(self._body).decode()):
                    self._add(value)
            self._body = None
        return normalize_usage(self.raw_usage)


class Refusal:
    """The body of a route response refused whole (a compressed one): the gateway's own error
    in its place, whatever the upstream sends (still counted by the meter)."""

    def __init__(self, meter: Meter, reason: str) -> None:
        self.meter = meter
        self.reason = reason
        self.body = json.dumps({"error": {"type": "fila_gateway", "message": reason}}).encode()
        self.sent = False

    def __call__(self, chunk: bytes) -> bytes:
        self.meter(chunk)
        if self.sent:
            return b""
        self.sent = True
        return self.body

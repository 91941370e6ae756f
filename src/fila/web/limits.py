"""What one request may cost `fila serve` before anyone is authenticated (docs/review-web.md,
"Limits"): a body of at most MAX_BODY bytes, read whole before routing within BODY_DEADLINE_S,
and never a multipart upload (no form of the server uploads a file).

The body is read here, once, and handed to the app from memory: a declared `Content-Length`
above the cap is refused before a byte is read, a chunked body as soon as it passes the cap, and
a client that sends its body too slowly is answered 408 and its connection closed. The forms are
a few short fields; 64 KiB leaves room for a long reason and refuses a flood.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

MAX_BODY = 64 << 10
BODY_DEADLINE_S = 30.0
# The form parser's own bounds, behind the cap: the server's forms have fewer than 10 fields.
MAX_FIELDS = 32


async def _answer(send: Any, status: int, text: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": text.encode() + b"\n"})


class BodyLimit:
    """The cap, the deadline and the refusal of multipart bodies, before routing (see the module
    doc)."""

    def __init__(self, app: Any, *, max_body: int = MAX_BODY) -> None:
        self.app, self.max_body = app, max_body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        kind = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if kind == b"multipart/form-data":
            await _answer(send, 415, "refused: multipart bodies (no form of this server uploads a file)")
            return
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            await _answer(send, 400, "refused: Content-Length is not a number")
            return
        if declared > self.max_body:
            await _answer(send, 413, f"refused: a body of {declared} bytes (at most {self.max_body})")
            return
        chunks: list[bytes] = []
        size, more = 0, True
        deadline_s = BODY_DEADLINE_S
        end = time.monotonic() + deadline_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, end - time.monotonic()))
            except TimeoutError:
                await _answer(send, 408, f"refused: the body took longer than {deadline_s:g} s")
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _answer(send, 413, f"refused: a body over {self.max_body} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, sent = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only a disconnect is left to hear

        await self.app(scope, replay, send)

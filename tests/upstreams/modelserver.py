"""A scripted model server and a static HTTPS server for tests: real HTTP(S), standard library only.

It runs inside the `fila/testnet` container (this file bind-mounted read-only) on the tests' own
`--internal` network, so engines and the gateway talk to a real server without the internet.

Model mode (`--mode model`) speaks four vendor APIs, streaming (SSE) and not:
  POST /v1/messages                                     Anthropic Messages
  POST /v1/chat/completions                             OpenAI Chat Completions
  POST /v1/responses                                    OpenAI Responses
  POST /v1beta/models/M:generateContent                 Gemini
  POST /v1beta/models/M:streamGenerateContent?alt=sse   Gemini, streamed
and answers from a SCRIPT (JSON, see tests/upstreams/README.md): a list of steps, each a reply
(text, or a tool call), an error (429/401/500 with the vendor's error body), a hang or a malformed
stream, with usage numbers. The script file is re-read when it changes (the test writes it on the
host); `POST /_control/script` replaces it too. An exhausted script answers a clear 500.

Static mode (`--mode static`) answers any method and path with `hello from <name>`, so a test
sees WHICH server answered.

Both append every request (method, path, query, headers, body up to 64 KiB) as one JSON line to
`<log-dir>/requests.jsonl`, and create `<log-dir>/ready` once every port is bound.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import os
import re
import socketserver
import ssl
import threading
import time
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

BODY_LOG_LIMIT = 64 * 1024
BODY_READ_LIMIT = 16 * 1024 * 1024
DEFAULT_USAGE = {"input_tokens": 10, "output_tokens": 5}

ERRORS = {  # status -> (anthropic type, openai type/code, gemini status)
    400: ("invalid_request_error", "invalid_request_error", "INVALID_ARGUMENT"),
    401: ("authentication_error", "invalid_api_key", "UNAUTHENTICATED"),
    403: ("permission_error", "insufficient_permissions", "PERMISSION_DENIED"),
    404: ("not_found_error", "model_not_found", "NOT_FOUND"),
    429: ("rate_limit_error", "rate_limit_exceeded", "RESOURCE_EXHAUSTED"),
    500: ("api_error", "server_error", "INTERNAL"),
    529: ("overloaded_error", "server_error", "UNAVAILABLE"),
}


def protocol_of(method: str, path: str) -> tuple[str | None, bool | None]:
    """(protocol, streaming-by-path) of a request; streaming None means 'read it from the body'."""
    if method != "POST":
        return None, None
    if path.endswith("/v1/messages"):
        return "anthropic", None
    if path.endswith("/v1/chat/completions"):
        return "openai", None
    if path.endswith("/v1/responses"):
        return "responses", None
    if "/models/" in path and path.endswith(":streamGenerateContent"):
        return "gemini", True
    if "/models/" in path and path.endswith(":generateContent"):
        return "gemini", False
    return None, None


def has_tool_result(protocol: str, body: dict[str, Any]) -> bool:
    """Whether the last message carries a tool result (the 'tool_result' rule of a step)."""
    if protocol == "anthropic":
        msgs = body.get("messages") or []
        content = msgs[-1].get("content") if msgs and isinstance(msgs[-1], dict) else None
        return isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in content
        )
    if protocol == "openai":
        msgs = body.get("messages") or []
        return bool(msgs) and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "tool"
    if protocol == "responses":
        items = body.get("input")
        last = items[-1] if isinstance(items, list) and items else None
        return isinstance(last, dict) and str(last.get("type", "")).endswith("call_output")
    if protocol == "gemini":
        contents = body.get("contents") or []
        parts = contents[-1].get("parts") if contents and isinstance(contents[-1], dict) else None
        return isinstance(parts, list) and any(isinstance(p, dict) and "functionResponse" in p for p in parts)
    return False


class Script:
    """The steps and which are used. The file is re-read when its content changes (then nothing
    is used yet); a POSTed script replaces the steps until the file changes again."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.steps: list[dict[str, Any]] = []
        self.used: list[bool] = []
        self.file_digest = ""

    def _reload(self) -> None:
        if self.path is None or not self.path.is_file():
            return
        raw = self.path.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != self.file_digest:
            self.set(json.loads(raw or b"{}"))
            self.file_digest = digest

    def set(self, doc: Any) -> None:
        steps = doc.get("steps", []) if isinstance(doc, dict) else doc
        if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
            raise ValueError("a script is {'steps': [ {...}, ... ]}")
        self.steps, self.used = steps, [False] * len(steps)

    def post(self, doc: Any) -> None:
        with self.lock:
            self._reload()  # a pending file change must not undo this script later
            self.set(doc)

    def take(self, protocol: str, tool_result: bool) -> tuple[int, dict[str, Any]] | None:
        """The first unused step for this protocol whose rule matches; marked used."""
        with self.lock:
            self._reload()
            for i, step in enumerate(self.steps):
                if self.used[i] or step.get("protocol", "any") not in ("any", protocol):
                    continue
                when = step.get("when")
                if when == "tool_result" and not tool_result:
                    continue
                if when == "no_tool_result" and tool_result:
                    continue
                self.used[i] = True
                return i, step
            return None

    def state(self) -> dict[str, Any]:
        with self.lock:
            self._reload()
            return {"steps": len(self.steps), "used": [i for i, u in enumerate(self.used) if u]}


# ---------------------------------------------------------------- reply shapes, one set per vendor


def _usage(step: dict[str, Any]) -> tuple[int, int]:
    u = {**DEFAULT_USAGE, **(step.get("usage") or {})}
    return int(u["input_tokens"]), int(u["output_tokens"])


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _halves(s: str) -> list[str]:
    """A streamed value in two pieces, so clients and the gateway really see a stream."""
    mid = len(s) // 2
    return [p for p in (s[:mid], s[mid:]) if p] or [""]


def _tool(step: dict[str, Any]) -> dict[str, Any] | None:
    reply = step.get("reply") or {}
    return reply.get("tool")


def _args_json(tool: dict[str, Any]) -> str:
    return json.dumps(tool.get("arguments", {}))


def anthropic_events(step: dict[str, Any], model: str) -> list[tuple[str, dict[str, Any]]]:
    inp, out = _usage(step)
    tool = _tool(step)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    # Like the real API: message_start carries input_tokens (and output_tokens 1), message_delta
    # the final, cumulative output_tokens.
    start_usage = {
        "input_tokens": inp,
        "output_tokens": min(1, out),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    ev: list[tuple[str, dict[str, Any]]] = [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": start_usage,
                },
            },
        ),
        ("ping", {"type": "ping"}),
    ]
    if tool is not None:
        block = {"type": "tool_use", "id": tool.get("id") or f"toolu_{uuid.uuid4().hex[:20]}"}
        block |= {"name": tool["name"], "input": {}}
        ev.append(
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
        )
        for piece in _halves(_args_json(tool)):
            delta = {"type": "input_json_delta", "partial_json": piece}
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}))
        stop = "tool_use"
    else:
        text = str((step.get("reply") or {}).get("text", ""))
        block = {"type": "text", "text": ""}
        ev.append(
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
        )
        for piece in _halves(text):
            delta = {"type": "text_delta", "text": piece}
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}))
        stop = "end_turn"
    ev.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    ev.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": out},
            },
        )
    )
    ev.append(("message_stop", {"type": "message_stop"}))
    return ev


def anthropic_body(step: dict[str, Any], model: str) -> dict[str, Any]:
    inp, out = _usage(step)
    tool = _tool(step)
    if tool is not None:
        tid = tool.get("id") or f"toolu_{uuid.uuid4().hex[:20]}"
        content = [{"type": "tool_use", "id": tid, "name": tool["name"], "input": tool.get("arguments", {})}]
        stop = "tool_use"
    else:
        content = [{"type": "text", "text": str((step.get("reply") or {}).get("text", ""))}]
        stop = "end_turn"
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {
            "input_tokens": inp,
            "output_tokens": out,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _openai_usage(step: dict[str, Any]) -> dict[str, int]:
    inp, out = _usage(step)
    return {"prompt_tokens": inp, "completion_tokens": out, "total_tokens": inp + out}


def openai_chunks(step: dict[str, Any], model: str) -> list[dict[str, Any]]:
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        return base | {"choices": choices} | extra

    tool = _tool(step)
    out: list[dict[str, Any]] = []
    if tool is not None:
        call = {"index": 0, "id": tool.get("id") or f"call_{uuid.uuid4().hex[:20]}", "type": "function"}
        call["function"] = {"name": tool["name"], "arguments": ""}
        first = {"role": "assistant", "content": None, "tool_calls": [call]}
        out.append(chunk([{"index": 0, "delta": first, "finish_reason": None}]))
        for piece in _halves(_args_json(tool)):
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
            out.append(chunk([{"index": 0, "delta": delta, "finish_reason": None}]))
        finish = "tool_calls"
    else:
        out.append(
            chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        )
        for piece in _halves(str((step.get("reply") or {}).get("text", ""))):
            out.append(chunk([{"index": 0, "delta": {"content": piece}, "finish_reason": None}]))
        finish = "stop"
    out.append(chunk([{"index": 0, "delta": {}, "finish_reason": finish}]))
    if not step.get("_no_usage"):
        out.append(chunk([], usage=_openai_usage(step)))  # the final usage chunk (stream_options)
    return out


def openai_body(step: dict[str, Any], model: str) -> dict[str, Any]:
    tool = _tool(step)
    if tool is not None:
        call = {"id": tool.get("id") or f"call_{uuid.uuid4().hex[:20]}", "type": "function"}
        call["function"] = {"name": tool["name"], "arguments": _args_json(tool)}
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": str((step.get("reply") or {}).get("text", ""))}
        finish = "stop"
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": _openai_usage(step),
    }


def _responses_item(step: dict[str, Any]) -> dict[str, Any]:
    tool = _tool(step)
    if tool is None:
        text = str((step.get("reply") or {}).get("text", ""))
        content = [{"type": "output_text", "text": text, "annotations": []}]
        return {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "status": "completed",
            "role": "assistant",
            "content": content,
        }
    call_id = tool.get("id") or f"call_{uuid.uuid4().hex[:20]}"
    if "input" in tool:  # a free-form tool such as codex's apply_patch
        return {
            "type": "custom_tool_call",
            "id": f"ctc_{uuid.uuid4().hex[:20]}",
            "status": "completed",
            "call_id": call_id,
            "name": tool["name"],
            "input": str(tool["input"]),
        }
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex[:20]}",
        "status": "completed",
        "call_id": call_id,
        "name": tool["name"],
        "arguments": _args_json(tool),
    }


def responses_body(step: dict[str, Any], model: str, item: dict[str, Any] | None = None) -> dict[str, Any]:
    inp, out = _usage(step)
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": model,
        "output": [item or _responses_item(step)],
        "usage": {
            "input_tokens": inp,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": inp + out,
        },
    }


def responses_events(step: dict[str, Any], model: str) -> list[tuple[str, dict[str, Any]]]:
    item = _responses_item(step)
    done = responses_body(step, model, item)
    created = done | {"status": "in_progress", "output": [], "usage": None}
    ev: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"type": "response.created", "response": created}),
        ("response.in_progress", {"type": "response.in_progress", "response": created}),
        (
            "response.output_item.added",
            {"type": "response.output_item.added", "output_index": 0, "item": item},
        ),
    ]
    if item["type"] == "message":
        for piece in _halves(item["content"][0]["text"]):
            ev.append(
                (
                    "response.output_text.delta",
                    {
                        "type": "response.output_text.delta",
                        "item_id": item["id"],
                        "output_index": 0,
                        "content_index": 0,
                        "delta": piece,
                    },
                )
            )
    ev.append(
        ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item})
    )
    ev.append(("response.completed", {"type": "response.completed", "response": done}))
    for n, (_, data) in enumerate(ev):
        data["sequence_number"] = n
    return ev


def gemini_chunks(step: dict[str, Any], model: str) -> list[dict[str, Any]]:
    inp, out = _usage(step)
    usage = {"promptTokenCount": inp, "candidatesTokenCount": out, "totalTokenCount": inp + out}
    tool = _tool(step)
    if tool is not None:
        pieces = [[{"functionCall": {"name": tool["name"], "args": tool.get("arguments", {})}}]]
    else:
        pieces = [[{"text": p}] for p in _halves(str((step.get("reply") or {}).get("text", "")))]
    chunks = []
    for n, parts in enumerate(pieces):
        cand: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
        chunk: dict[str, Any] = {"candidates": [cand], "modelVersion": model}
        if n == len(pieces) - 1:  # the final chunk: finishReason and the request's usage
            cand["finishReason"] = "STOP"
            chunk["usageMetadata"] = usage
        chunks.append(chunk)
    return chunks


def gemini_body(step: dict[str, Any], model: str) -> dict[str, Any]:
    chunks = gemini_chunks(step, model)
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    if parts and all("text" in p for p in parts):
        parts = [{"text": "".join(p["text"] for p in parts)}]
    last = chunks[-1]
    cand = {"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}
    return {"candidates": [cand], "usageMetadata": last["usageMetadata"], "modelVersion": model}


def error_body(protocol: str, status: int, message: str) -> dict[str, Any]:
    a_type, o_type, g_status = ERRORS.get(status, ("api_error", "server_error", "UNKNOWN"))
    if protocol == "anthropic":
        return {"type": "error", "error": {"type": a_type, "message": message}}
    if protocol == "gemini":
        return {"error": {"code": status, "message": message, "status": g_status}}
    return {"error": {"message": message, "type": o_type, "param": None, "code": o_type}}


# ------------------------------------------------------------------------------------ the server


class Counted:
    """A connection's reader counting the bytes read through it: the log says how many bytes a
    request took on the wire (what a client or a gateway sent, to compare with what it says it sent)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.count = 0

    def readline(self, *a: Any) -> bytes:
        data = self.f.readline(*a)
        self.count += len(data)
        return data

    def read(self, *a: Any) -> bytes:
        data = self.f.read(*a)
        self.count += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fila-test-upstream/1"
    timeout = 120  # a stuck client frees its thread

    # set by main()
    mode = "model"
    name = "model.test"
    log_dir = Path("/log")
    script = Script(None)
    log_lock = threading.Lock()
    files: dict[str, tuple[bytes, str]] = {}  # noqa: RUF012  (the Files-API store, server-wide)
    files_lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the JSON request log is the record; stderr stays quiet

    def _log(self, body: bytes, **extra: Any) -> None:
        url = urlsplit(self.path)
        entry = {
            "t": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "server": self.name,
            "scheme": "https" if isinstance(self.connection, ssl.SSLSocket) else "http",
            "port": self.server.server_address[1],
            "client": self.client_address[0],
            "method": self.command,
            "path": url.path,
            "query": parse_qs(url.query, keep_blank_values=True),
            "raw_query": url.query,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body[:BODY_LOG_LIMIT].decode("utf-8", errors="replace"),
            "body_bytes": len(body),
            "body_truncated": len(body) > BODY_LOG_LIMIT,
            "wire_bytes": self.rfile.count - self.request_start,  # request line, headers, body as read
        } | extra
        line = json.dumps(entry) + "\n"
        with self.log_lock, open(self.log_dir / "requests.jsonl", "a") as f:
            f.write(line)

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
                if len(data) > BODY_READ_LIMIT:
                    raise ValueError("request body too large")
        if n > BODY_READ_LIMIT:
            raise ValueError("request body too large")
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes, ctype: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Served-By", self.name)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, doc: Any, **headers: str) -> None:
        self._send(status, json.dumps(doc).encode(), **headers)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Served-By", self.name)
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def setup(self) -> None:
        super().setup()
        self.rfile = Counted(self.rfile)  # type: ignore[assignment]

    def handle_one_request(self) -> None:
        self.request_start = self.rfile.count
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError, ssl.SSLError):
            self.close_connection = True

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    def _dispatch(self) -> None:
        try:
            body = self._read_body()
        except ValueError as e:
            self._log(b"", status=413)
            self._json(413, {"error": str(e)})
            return
        path = urlsplit(self.path).path
        if self.mode == "model" and path.startswith("/_control/"):
            self._control(path, body)  # not logged: the log is what clients sent to the API
            return
        if self.mode == "static":
            self._log(body, status=200)
            self._send(200, f"hello from {self.name}\n".encode(), "text/plain; charset=utf-8")
            return
        self._model(path, body)

    def _control(self, path: str, body: bytes) -> None:
        if path == "/_control/script" and self.command == "POST":
            try:
                self.script.post(json.loads(body))
            except ValueError as e:
                self._json(400, {"error": f"bad script: {e}"})
                return
        self._json(200, self.script.state())

    def _files(self, path: str, body: bytes) -> bool:
        """A Files-API-like store (OpenAI/Anthropic /v1/files): POST /v1/files keeps the body,
        GET /v1/files/<id>/content gives it back as it came, with the content type it was sent
        with: a body the client wrote, served by the model API's host."""
        if self.command == "POST" and path.endswith("/v1/files"):
            fid = f"file-{uuid.uuid4().hex[:12]}"
            with self.files_lock:
                self.files[fid] = (body, self.headers.get("content-type") or "application/octet-stream")
            self._log(body, status=200, protocol="files", step=None)
            self._json(200, {"id": fid, "object": "file", "bytes": len(body)})
            return True
        parts = path.split("/")
        if self.command == "GET" and len(parts) >= 4 and parts[-1] == "content" and parts[-3] == "files":
            with self.files_lock:
                got = self.files.get(parts[-2])
            self._log(body, status=200 if got else 404, protocol="files", step=None)
            if got is None:
                self._json(404, {"error": f"no file {parts[-2]}"})
            else:
                self._send(200, got[0], got[1])
            return True
        return False

    def _model(self, path: str, body: bytes) -> None:
        if self._files(path, body):
            return
        protocol, stream = protocol_of(self.command, path)
        if protocol is None:
            self._log(body, status=404, protocol=None, step=None)
            self._json(404, {"error": f"no API at {self.command} {path} on {self.name}"})
            return
        try:
            doc = json.loads(body or b"{}")
            if not isinstance(doc, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as e:
            self._log(body, status=400, protocol=protocol, step=None)
            self._json(400, error_body(protocol, 400, f"invalid JSON body: {e}"))
            return
        if stream is None:
            stream = bool(doc.get("stream"))
        model = str(doc.get("model") or path.rsplit("/models/", 1)[-1].split(":")[0] or "test-model")
        taken = self.script.take(protocol, has_tool_result(protocol, doc))
        if taken is None:
            self._log(body, status=500, protocol=protocol, stream=stream, step=None)
            msg = f"fila test model server: script exhausted (no step left for {protocol})"
            self._json(500, error_body(protocol, 500, msg))
            return
        index, step = taken
        opts = doc.get("stream_options")
        if step.get("stream_usage") == "when_asked" and not (
            isinstance(opts, dict) and opts.get("include_usage")
        ):
            step = {**step, "_no_usage": True}  # like OpenAI: a chat stream's usage only when asked
        err = step.get("error")
        status = int(err.get("status", 500)) if isinstance(err, dict) else 200
        self._log(body, status=status, protocol=protocol, stream=stream, step=index)
        if step.get("hang"):
            time.sleep(float(step["hang"]))
        if isinstance(err, dict):
            msg = str(err.get("message") or f"scripted error {status}")
            headers = {"retry_after": str(err.get("retry_after", 1))} if status == 429 else {}
            self._json(status, error_body(protocol, status, msg), **headers)
            return
        malformed = step.get("malformed")
        if malformed:
            self._malformed(protocol, stream, "truncated" if malformed is True else str(malformed), model)
            return
        if step.get("reflect"):
            self._reflect(str(step["reflect"]), step, model)
            return
        if not stream:
            makers = {"anthropic": anthropic_body, "openai": openai_body, "responses": responses_body}
            self._json(200, makers.get(protocol, gemini_body)(step, model))
            return
        self._start_stream()
        for event in self._events(protocol, step, model):
            self._chunk(event)
        self._end_stream()

    def _events(self, protocol: str, step: dict[str, Any], model: str) -> list[bytes]:
        if protocol == "anthropic":
            return [
                f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in anthropic_events(step, model)
            ]
        if protocol == "responses":
            return [
                f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in responses_events(step, model)
            ]
        if protocol == "openai":
            done = [b"data: [DONE]\n\n"]
            return [f"data: {json.dumps(c)}\n\n".encode() for c in openai_chunks(step, model)] + done
        return [f"data: {json.dumps(c)}\n\n".encode() for c in gemini_chunks(step, model)]

    def _reflect(self, form: str, step: dict[str, Any], model: str) -> None:
        """An upstream that echoes the request's headers (a debugging endpoint, an error quoting the
        request): `form` says how. Every credential-like header value comes back in it."""
        self.close_connection = True
        heads = {k.lower(): v for k, v in self.headers.items()}
        secrets = [heads[h] for h in ("x-api-key", "authorization", "x-goog-api-key") if h in heads]
        doc = json.dumps({"type": "error", "echo": {"headers": heads}}).encode()
        if form == "plain":  # in the status line, in headers and in the body
            self.send_response(200, f"OK {' '.join(secrets)}")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(doc)))
            for k, v in heads.items():
                self.send_header(f"X-Echo-{k}", v)
            self.end_headers()
            self.wfile.write(doc)
        elif form == "chunked":  # chunks of 7 bytes: every key is split across chunks
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(doc), 7):
                self._chunk(doc[i : i + 7])
                time.sleep(0.002)
            self._end_stream()
        elif form == "raw":  # bytes as the step gives them (an unparseable head, a 101), then close
            key = " ".join(secrets)  # {key1} and {key2}: its two halves, for a key split in two
            halves = {"{key}": key, "{key1}": key[: len(key) // 2], "{key2}": key[len(key) // 2 :]}
            for piece in step.get("raw") or []:
                piece = re.sub(r"\{key[12]?\}", lambda m: halves[m[0]], str(piece))
                self.wfile.write(piece.encode("latin-1"))
                self.wfile.flush()
                time.sleep(float(step.get("pause", 0.2)))
        elif form == "sse":  # an Anthropic stream whose text is the key, split across events
            text = "the key is " + " ".join(secrets)
            mid = len(text) // 2 + 7
            step = {**step, "reply": {"text": ""}}
            events = anthropic_events(step, model)
            deltas = [
                ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": piece}})
                for piece in (text[:mid], text[mid:])
            ]  # fmt: skip
            events = [e for e in events if e[0] != "content_block_delta"]
            at = next(i for i, e in enumerate(events) if e[0] == "content_block_stop")
            events[at:at] = deltas
            sep = str(step.get("separator", "\n\n"))  # the blank line's line ends (LF, CRLF, CR)
            raw = b"".join(f"event: {n}\ndata: {json.dumps(d)}{sep}".encode() for n, d in events)
            raw += f"data: {json.dumps({'echo': secrets})}{sep}".encode()
            if step.get("pad"):  # first, a ping event of this many bytes
                raw = (
                    b'event: ping\ndata: {"type": "ping", "pad": "'
                    + b"x" * int(step["pad"])
                    + b'"}\n\n'
                    + raw
                )
            raw = str(step.get("prefix", "")).encode() + raw
            self.send_response(200)
            self.send_header("Content-Type", str(step.get("content_type", "text/event-stream")))
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            size = int(step.get("chunk", 5))
            for i in range(0, len(raw), size):  # mid-key chunk boundaries too
                self._chunk(raw[i : i + size])
            self._end_stream()
        elif form == "gzip":  # compressed although the request asked for identity
            self._send(200, gzip.compress(doc), Content_Encoding="gzip")
        else:
            encoded = {
                # each at the three offsets base64 can have inside a longer text
                "base64": lambda v: [base64.b64encode((p + v).encode()).decode() for p in ("", "x", "xy")]
                + [base64.urlsafe_b64encode((p + v).encode()).decode() for p in ("", "x", "xy")],
                "urlencoded": lambda v: [quote(v, safe=""), "".join(f"%{ord(c):02x}" for c in v),
                                         "".join(f"%{ord(c):02X}" for c in v)],
                "json-escaped": lambda v: ["".join(f"\\u{ord(c):04x}" for c in v),
                                           "".join(f"\\u{ord(c):04X}" for c in v)],
                "hex": lambda v: [v.encode().hex(), v.encode().hex().upper()],
                "html": lambda v: ["".join(f"&#{ord(c)};" for c in v), "".join(f"&#x{ord(c):x};" for c in v)],
                # without the `;` a browser does without, and with many leading zeros
                "html-loose": lambda v: ["".join(f"&#{ord(c)}" for c in v),
                                         "".join(f"&#x0000000{ord(c):x};" for c in v)],
                "js-hex": lambda v: ["".join(f"\\x{ord(c):02x}" for c in v),
                                     "".join(f"\\x{ord(c):02X}" for c in v)],
                # broken by spaces, and by lone CRs
                "base64-spaced": lambda v: [" ".join(re.findall(".{1,4}", _b64(v))),
                                            "\r".join(re.findall(".{1,8}", _b64(v)))],
                "percent-twice": lambda v: ["".join(f"%25{ord(c):02X}" for c in v)],
                # MIME-wrapped (76 columns, CRLF), and with a JSON-escaped line break inside
                "base64-lines": lambda v: [base64.encodebytes(("x" * 50 + v).encode()).decode()
                                           .replace("\n", "\r\n"),
                                           base64.b64encode(v.encode()).decode()[:20] + "\\n"
                                           + base64.b64encode(v.encode()).decode()[20:]],
            }[form]  # fmt: skip
            parts = [x for v in secrets for x in encoded(v)]
            self._send(200, ('{"echo": ["' + '", "'.join(parts) + '"]}').encode())

    def _malformed(self, protocol: str, stream: bool, kind: str, model: str) -> None:
        """'json': a complete response whose JSON is broken; 'truncated': the connection is cut
        in the middle of the response."""
        self.close_connection = True
        if not stream:
            if kind == "json":
                self._send(200, b'{"id": "broken", "content": [{"type": "text", "text": "unterminated')
            else:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "4096")
                self.end_headers()
                self.wfile.write(b'{"id": "cut", "content": [')
                self.wfile.flush()
            return
        events = self._events(protocol, {"reply": {"text": "this stream breaks"}}, model)
        self._start_stream()
        self._chunk(events[0])
        if kind == "json":
            self._chunk(b'data: {"type": "content_block_delta", "delta": {"text": "unterminated\n\n')
            self._end_stream()
        else:
            self.wfile.write(b'400\r\ndata: {"type": "content_blo')  # a chunk promised, never sent
            self.wfile.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def serve(port: int, tls: ssl.SSLContext | None) -> Server:
    srv = Server(("0.0.0.0", port), Handler)
    if tls is not None:
        # Handshake lazily in the request's own thread: a slow client never blocks accept().
        srv.socket = tls.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=srv.serve_forever, name=f"port-{port}", daemon=True).start()
    return srv


BANNER = b"SSH-2.0-fila-test-banner\r\n"


def serve_banner(port: int) -> socketserver.ThreadingTCPServer:
    """A server that speaks first (like ssh): BANNER as soon as a client connects, then, for the
    first bytes the client sends, `got N bytes` and the close."""

    class Banner(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.settimeout(10)
            try:
                self.request.sendall(BANNER)
                data = self.request.recv(65536)
                self.request.sendall(f"got {len(data)} bytes\n".encode())
            except OSError:
                pass

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    srv = socketserver.ThreadingTCPServer(("0.0.0.0", port), Banner)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name=f"banner-{port}", daemon=True).start()
    return srv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["model", "static"], default="model")
    ap.add_argument("--name", required=True, help="the DNS name this server answers as")
    ap.add_argument("--http-port", type=int, action="append", default=[])
    ap.add_argument("--https-port", type=int, action="append", default=[])
    ap.add_argument("--cert", type=Path, help="PEM certificate (HTTPS)")
    ap.add_argument("--key", type=Path, help="PEM private key (HTTPS)")
    ap.add_argument("--script", type=Path, help="script file, re-read when it changes")
    ap.add_argument("--log-dir", type=Path, default=Path("/log"))
    ap.add_argument("--banner-port", type=int, action="append", default=[], help="a server-first port")
    a = ap.parse_args()
    Handler.mode, Handler.name, Handler.log_dir = a.mode, a.name, a.log_dir
    Handler.script = Script(a.script)
    tls = None
    if a.https_port:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(a.cert, a.key)
    servers: list[Any] = [serve(p, None) for p in a.http_port] + [serve(p, tls) for p in a.https_port]
    servers += [serve_banner(p) for p in a.banner_port]
    (a.log_dir / "ready").write_text(json.dumps({"pid": os.getpid(), "ports": a.http_port + a.https_port}))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        for s in servers:
            s.shutdown()


if __name__ == "__main__":
    main()

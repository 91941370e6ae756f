"""The shared Debian base, fila/testnet and the test upstreams, on the real Docker daemon.

The servers answer from a client container on their sealed network (over HTTPS verified against
the test CA), the model server plays its script in each vendor's shape, streamed and not, and its
errors, hangs and broken streams really happen (each next to a request that succeeds)."""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import re
import socket
import subprocess
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest

from fila.core.errors import ImageMissing
from fila.sandbox import image_bases, images
from fila.sandbox.docker.backend import DockerBackend
from tests.support.cli import fila
from tests.support.project import make_root, record
from tests.upstreams import Upstreams
from tests.upstreams.fixtures import LABEL, check_no_route_out, create_on_free_subnet

pytestmark = pytest.mark.docker

CA = "/etc/fila-test/ca.crt"
MARK = "=====fila-test-response"


# ------------------------------------------------------------------------------- helpers


def call(upstreams: Upstreams, reqs: list[dict[str, Any]], *, timeout: float = 60) -> list[dict[str, Any]]:
    """Send each request with curl from ONE client container; returns per request its curl exit
    code, HTTP status and body. A request: {path, body (JSON-able), host, scheme, headers, max_time}."""
    script, env = [], {}
    for i, r in enumerate(reqs):
        env[f"B{i}"] = json.dumps(r.get("body", {}))
        host, scheme = r.get("host", "model.test"), r.get("scheme", "https")
        heads = " ".join(
            f"-H '{k}: {v}'" for k, v in {"content-type": "application/json", **r.get("headers", {})}.items()
        )
        max_time = f"--max-time {r['max_time']}" if "max_time" in r else "--max-time 20"
        script.append(
            f'out=$(curl -sS -N --cacert {CA} {max_time} {heads} --data-binary "$B{i}" '
            f"-w '\\n%{{http_code}}' {scheme}://{host}{r['path']} 2>/tmp/err); rc=$?; "
            f'printf "%s\\n{MARK} {i} %s\\n" "$(printf %s "$out" | base64 -w0)" "$rc"'
        )
    res = upstreams.run("; ".join(script), env=env, timeout=timeout)
    assert res.exit_code == 0, res.stderr
    out = []
    lines = res.stdout.splitlines()
    for n, line in enumerate(lines):
        if line.startswith(MARK):
            rc = int(line.split()[-1])
            raw = base64.b64decode(lines[n - 1]).decode(errors="replace")
            body, _, status = raw.rpartition("\n")
            out.append({"rc": rc, "status": int(status or 0), "body": body})
    assert len(out) == len(reqs), res.stdout
    return out


def sse(body: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event."""
    events = []
    for block in body.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            events.append((name, "\n".join(data)))
    return events


def sse_json(body: str) -> list[dict[str, Any]]:
    return [json.loads(d) for _, d in sse(body) if d != "[DONE]"]


TOOL = {"name": "Write", "arguments": {"file_path": "/job/work/a.txt", "content": "hello\n"}}


# ------------------------------------------------------------------ the Debian base and testnet


def test_debian_base_is_reused_while_its_definition_holds(
    docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    images.ensure_image("testnet", DockerBackend(docker_client), progress=lambda s: None)
    lines: list[str] = []
    ref = images.debian_base(DockerBackend(docker_client), progress=lines.append)
    labels = docker_client.images.get(ref.id).labels
    assert labels[images.LABEL_DEFINITION] == image_bases.definition_hash()
    assert lines == [f"local base {images.DEBIAN_TAG}: reusing {ref.id[:19]}"]

    def no_debootstrap(root: Path, progress: Any) -> None:
        raise ImageMissing("debootstrap would run")

    # A changed definition (another package) is a rebuild, not a reuse.
    monkeypatch.setattr(image_bases, "_debootstrap", no_debootstrap)
    monkeypatch.setitem(images.DEBIAN, "packages", ["curl"])
    with pytest.raises(ImageMissing, match="debootstrap would run"):
        images.debian_base(DockerBackend(docker_client), progress=lambda s: None)
    backend = DockerBackend(docker_client)
    assert images.find_image(backend, images.DEBIAN_TAG) == ref, "the old base stays until replaced"


def test_debian_base_rebuilds_for_a_ca_it_does_not_hold(
    docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    images.ensure_image("testnet", DockerBackend(docker_client), progress=lambda s: None)
    ref = images.debian_base(DockerBackend(docker_client), progress=lambda s: None)
    held = docker_client.images.get(ref.id).labels.get(images.LABEL_CA, "")
    monkeypatch.setattr(
        image_bases, "_debootstrap", lambda root, progress: (_ for _ in ()).throw(ImageMissing("rebuild"))
    )
    ca = tmp_path / "other-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nZmlsYS1vdGhlci1jYQ==\n-----END CERTIFICATE-----\n")
    with pytest.raises(ImageMissing, match="rebuild"):
        images.debian_base(DockerBackend(docker_client), ca_file=ca, progress=lambda s: None)
    # No CA asked for: whatever CA the base holds is fine (no flip-flopping between builds).
    assert images.debian_base(DockerBackend(docker_client), progress=lambda s: None) == ref
    assert docker_client.images.get(ref.id).labels.get(images.LABEL_CA, "") == held


def test_testnet_image_builds_on_the_debian_base_and_is_reused(
    docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = images.ensure_image("testnet", DockerBackend(docker_client), progress=lambda s: None)
    img = docker_client.images.get(ref.id)
    # Built FROM the imported Debian base of the current definition (its label is inherited).
    assert img.labels[images.LABEL_BASE] == images.DEBIAN_TAG
    assert img.labels[images.LABEL_DEFINITION] == image_bases.definition_hash()
    assert any("Imported from" in (h.get("Comment") or "") for h in img.history())
    lines: list[str] = []
    assert images.build("testnet", DockerBackend(docker_client), progress=lines.append) == ref
    assert len(lines) == 1 and "up to date" in lines[0]
    # A changed base definition makes the image stale: ensure_image would rebuild it.
    monkeypatch.setitem(images.DEBIAN, "packages", ["curl"])
    assert not images._up_to_date(img, images.context_hash(images.engine_dir("testnet")), None, None)


def test_testnet_runs_as_a_shell_engine_image_under_fila_sandbox(
    tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    images.ensure_image("testnet", DockerBackend(docker_client), progress=lambda s: None)
    make_root(tmp_path)
    (tmp_path / "out.txt").write_text("")
    cmd = (
        "{ id -u; echo $HOME; touch $HOME/h /tmp/t && echo writable; curl --version | head -c 4; echo;"
        " python3 -c 'print(6*7)'; openssl version | head -c 7; echo;"
        " { command -v dig; command -v ip; } | wc -l;"
        " touch /usr/x 2>/dev/null || echo root-read-only; } > out.txt"
    )
    task = {"id": "testnet-engine", "engine": "shell", "image": "fila/testnet:latest", "command": cmd}
    task |= {"targets": ["out.txt"], "timeout": 60000}
    (tmp_path / "task.json").write_text(json.dumps(task))
    assert fila(tmp_path, "submit", str(tmp_path / "task.json")).exit_code == 0
    res = fila(tmp_path, "run", "--once")
    assert res.exit_code == 0, res.output
    rec = record(tmp_path, "testnet-engine")
    assert rec["status"] == "needs_review" and rec["image"]["tag"] == "fila/testnet:latest"
    patch = fila(tmp_path, "diff", "testnet-engine").stdout
    added = [line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    # uid 65534 (fila runs as nobody when it is root), HOME and /tmp writable tmpfs, the tools
    # there, the root filesystem read-only.
    assert added == ["65534", "/home/fila", "writable", "curl", "42", "OpenSSL", "2", "root-read-only"], patch


# ------------------------------------------------------------------------ the sealed network


def test_every_server_answers_over_https_verified_by_the_test_ca(upstreams: Upstreams) -> None:
    cmd = "; ".join(
        f"curl -sS -w '\\n' --max-time 10 --cacert {CA} https://{name}{port}/"
        f" && curl -sS -w '\\n' --max-time 10 http://{name}{hp}/"
        for name in ("allowed.test", "other.allowed.test", "denied.test", "model.test")
        for port, hp in (("", ""), (":8443", ":8080"))
    )
    res = upstreams.run(cmd)
    assert res.exit_code == 0, res.stderr
    got = res.stdout.splitlines()
    assert got.count("hello from allowed.test") == 4 and got.count("hello from other.allowed.test") == 4
    assert got.count("hello from denied.test") == 4
    assert got.count('{"error": "no API at GET / on model.test"}') == 4
    # Verification is real: the same server under a name its certificate lacks, or without the
    # test CA, is refused (curl 60: certificate problem).
    ip = upstreams.ip("allowed.test")
    bad = upstreams.run(
        f"curl -sS --max-time 10 --cacert {CA} https://{ip}/; echo rc=$?; "
        "curl -sS --max-time 10 https://allowed.test/; echo rc=$?"
    )
    assert bad.stdout.count("rc=60") == 2, bad.stdout + bad.stderr
    assert [r["server"] for r in upstreams.requests("allowed.test")].count("allowed.test") >= 4


def test_the_network_probe_passes_here_and_fails_on_a_plain_internal_network(
    upstreams: Upstreams, docker_client: docker.DockerClient
) -> None:
    # The probe passed on the upstreams' own network when the fixture made it (it fails the
    # session otherwise); what it saw there:
    seen = upstreams.probe
    assert seen["knocks"] and "lladdr" not in seen["neighbour"]
    assert all(v != "connected" for v in seen["knocks"].values())
    # The counterpart: an --internal network WITHOUT inhibit_ipv4 (the host holds its gateway
    # address, so the host's services are reachable) is caught.
    net, subnet = create_on_free_subnet(
        docker_client,
        f"fila-test-plain-{upstreams.session}",
        options={},
        labels={LABEL: "upstreams", f"{LABEL}.session": upstreams.session},
    )
    host_side = re.escape(str(ipaddress.ip_network(subnet)[1]))
    try:
        with pytest.raises(RuntimeError, match=rf"{host_side} answers ARP"):
            check_no_route_out(docker_client, net.name, subnet, upstreams.session)
    finally:
        net.remove()


def test_a_client_reaches_the_servers_but_nothing_outside(upstreams: Upstreams) -> None:
    res = upstreams.run(
        f"curl -sS --max-time 10 --cacert {CA} https://allowed.test/; "
        "curl -sS --max-time 8 http://192.0.2.1/; echo rc=$?; "
        f"curl -sS --max-time 8 http://{upstreams.subnet.rsplit('.', 1)[0]}.1:2375/; echo rc=$?"
    )
    assert res.stdout.splitlines()[0] == "hello from allowed.test"
    # 7: could not connect (no route to host); 28 would be a timeout: both mean no answer.
    assert res.stdout.count("rc=7") + res.stdout.count("rc=28") == 2, res.stdout + res.stderr


# -------------------------------------------------------------------------- the model server


PROTOCOLS = {
    # protocol: (path, stream path or None, first user message, tool-result follow-up message)
    "anthropic": "/v1/messages",
    "openai": "/v1/chat/completions",
    "responses": "/v1/responses",
    "gemini": "/v1beta/models/gemini-test:generateContent",
}


def _bodies(protocol: str, stream: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(first request, follow-up carrying the tool result)."""
    if protocol == "anthropic":
        first = {"model": "claude-test", "stream": stream, "messages": [{"role": "user", "content": "write"}]}
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}
        return first, {**first, "messages": [*first["messages"], result]}
    if protocol == "openai":
        first = {"model": "gpt-test", "stream": stream, "messages": [{"role": "user", "content": "write"}]}
        return first, {
            **first,
            "messages": [*first["messages"], {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        }
    if protocol == "responses":
        first = {"model": "gpt-test", "stream": stream, "input": [{"role": "user", "content": "write"}]}
        out = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
        return first, {**first, "input": [*first["input"], out]}
    first = {"contents": [{"role": "user", "parts": [{"text": "write"}]}]}
    resp = {"role": "user", "parts": [{"functionResponse": {"name": "Write", "response": {"ok": True}}}]}
    return first, {"contents": [*first["contents"], resp]}


def _path(protocol: str, stream: bool) -> str:
    if protocol == "gemini" and stream:
        return "/v1beta/models/gemini-test:streamGenerateContent?alt=sse"
    return PROTOCOLS[protocol]


def _tool_and_usage(protocol: str, stream: bool, body: str) -> tuple[str, dict[str, Any], tuple[int, int]]:
    """(tool name, arguments, (input, output tokens)) from a response in the vendor's shape."""
    if protocol == "anthropic" and stream:
        ev = sse(body)
        names = [n for n, _ in ev]
        assert names[0] == "message_start" and names[-1] == "message_stop"
        data = [json.loads(d) for _, d in ev]
        start = next(d for d in data if d["type"] == "content_block_start")["content_block"]
        args = "".join(d["delta"]["partial_json"] for d in data if d["type"] == "content_block_delta")
        delta = next(d for d in data if d["type"] == "message_delta")
        assert delta["delta"]["stop_reason"] == "tool_use"
        return (
            start["name"],
            json.loads(args),
            (data[0]["message"]["usage"]["input_tokens"], delta["usage"]["output_tokens"]),
        )
    if protocol == "anthropic":
        doc = json.loads(body)
        block = doc["content"][0]
        assert doc["stop_reason"] == "tool_use" and block["type"] == "tool_use"
        return block["name"], block["input"], (doc["usage"]["input_tokens"], doc["usage"]["output_tokens"])
    if protocol == "openai" and stream:
        assert body.rstrip().endswith("data: [DONE]")
        chunks = sse_json(body)
        calls = [c["choices"][0]["delta"].get("tool_calls", [{}])[0] for c in chunks if c["choices"]]
        name = calls[0]["function"]["name"]
        args = "".join(c.get("function", {}).get("arguments", "") for c in calls)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == []
        return name, json.loads(args), (usage["prompt_tokens"], usage["completion_tokens"])
    if protocol == "openai":
        doc = json.loads(body)
        fn = doc["choices"][0]["message"]["tool_calls"][0]["function"]
        return (
            fn["name"],
            json.loads(fn["arguments"]),
            (doc["usage"]["prompt_tokens"], doc["usage"]["completion_tokens"]),
        )
    if protocol == "responses":
        if stream:
            ev = sse(body)
            assert ev[0][0] == "response.created"
            item = next(json.loads(d)["item"] for n, d in ev if n == "response.output_item.done")
            doc = next(json.loads(d)["response"] for n, d in ev if n == "response.completed")
        else:
            doc = json.loads(body)
            item = doc["output"][0]
        assert item["type"] == "function_call"
        return (
            item["name"],
            json.loads(item["arguments"]),
            (doc["usage"]["input_tokens"], doc["usage"]["output_tokens"]),
        )
    chunks = sse_json(body) if stream else [json.loads(body)]
    call = chunks[0]["candidates"][0]["content"]["parts"][0]["functionCall"]
    meta = chunks[-1]["usageMetadata"]
    return call["name"], call["args"], (meta["promptTokenCount"], meta["candidatesTokenCount"])


def _text(protocol: str, stream: bool, body: str) -> str:
    if protocol == "anthropic" and stream:
        data = sse_json(body)
        assert next(d for d in data if d["type"] == "message_delta")["delta"]["stop_reason"] == "end_turn"
        return "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    if protocol == "anthropic":
        return json.loads(body)["content"][0]["text"]
    if protocol == "openai" and stream:
        chunks = [c for c in sse_json(body) if c["choices"]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    if protocol == "openai":
        return json.loads(body)["choices"][0]["message"]["content"]
    if protocol == "responses":
        if stream:
            ev = sse(body)
            deltas = "".join(json.loads(d)["delta"] for n, d in ev if n == "response.output_text.delta")
            doc = next(json.loads(d)["response"] for n, d in ev if n == "response.completed")
            assert doc["output"][0]["content"][0]["text"] == deltas
        else:
            doc = json.loads(body)
        return doc["output"][0]["content"][0]["text"]
    chunks = sse_json(body) if stream else [json.loads(body)]
    return "".join(p["text"] for c in chunks for p in c["candidates"][0]["content"]["parts"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_model_server_plays_a_tool_call_then_text_with_usage(
    upstreams: Upstreams, protocol: str, stream: bool
) -> None:
    upstreams.set_script(
        [
            {
                "protocol": protocol,
                "when": "no_tool_result",
                "reply": {"tool": TOOL},
                "usage": {"input_tokens": 123, "output_tokens": 45},
            },
            {"protocol": protocol, "when": "tool_result", "reply": {"text": "All done, file written."}},
        ]
    )
    upstreams.clear_requests("model.test")
    first, follow = _bodies(protocol, stream)
    path = _path(protocol, stream)
    # The follow-up goes first: the rules, not the order, pick each step.
    got = call(
        upstreams,
        [
            {"path": path, "body": follow, "headers": {"x-api-key": "key-one"}},
            {"path": path, "body": first, "headers": {"authorization": "Bearer key-two"}},
            {"path": path, "body": first, "scheme": "http"},
        ],
    )
    assert [g["status"] for g in got] == [200, 200, 500], got
    assert _text(protocol, stream, got[0]["body"]) == "All done, file written."
    name, args, usage = _tool_and_usage(protocol, stream, got[1]["body"])
    assert (name, args, usage) == ("Write", TOOL["arguments"], (123, 45))
    assert "script exhausted" in got[2]["body"]
    log = upstreams.requests("model.test")
    assert [(e["step"], e["status"], e["protocol"], e["scheme"]) for e in log] == [
        (1, 200, protocol, "https"),
        (0, 200, protocol, "https"),
        (None, 500, protocol, "http"),
    ]
    assert (
        log[0]["headers"]["x-api-key"] == "key-one" and log[1]["headers"]["authorization"] == "Bearer key-two"
    )
    assert json.loads(log[1]["body"]) == first and log[1]["path"] == path.split("?")[0]
    if protocol == "gemini" and stream:
        assert log[0]["query"] == {"alt": ["sse"]}


def test_streams_arrive_in_several_chunks_with_chunked_encoding(upstreams: Upstreams) -> None:
    upstreams.set_script([{"reply": {"text": "one two three four"}}])
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    res = upstreams.run(
        f"curl -sS -N -D - --raw --cacert {CA} -H 'content-type: application/json' "
        f"--data-binary '{body}' https://model.test/v1/messages"
    )
    assert res.exit_code == 0, res.stderr
    head, _, raw = res.stdout.partition("\r\n\r\n")
    assert "transfer-encoding: chunked" in head.lower() and "text/event-stream" in head
    # --raw keeps the chunk framing: one chunk per SSE event, the text in two deltas.
    assert raw.count("\r\nevent: ") + raw.startswith(("event: ", "1")) >= 7
    assert _text("anthropic", True, "".join(line for line in raw.split("\r\n") if not _is_hex(line)))


def _is_hex(line: str) -> bool:
    return bool(line) and all(c in "0123456789abcdef" for c in line)


@pytest.mark.parametrize(
    ("status", "anthropic_type", "openai_code", "gemini_status"),
    [
        (429, "rate_limit_error", "rate_limit_exceeded", "RESOURCE_EXHAUSTED"),
        (401, "authentication_error", "invalid_api_key", "UNAUTHENTICATED"),
        (500, "api_error", "server_error", "INTERNAL"),
    ],
)
def test_model_server_answers_scripted_errors_in_each_vendor_shape(
    upstreams: Upstreams, status: int, anthropic_type: str, openai_code: str, gemini_status: str
) -> None:
    upstreams.set_script(
        [
            {"protocol": "anthropic", "reply": {"text": "fine"}},
            *(
                {"protocol": p, "error": {"status": status, "message": f"scripted {status}"}}
                for p in ("anthropic", "openai", "responses", "gemini")
            ),
        ]
    )
    reqs = [{"path": "/v1/messages", "body": _bodies("anthropic", False)[0]}]
    reqs += [{"path": _path(p, False), "body": _bodies(p, False)[0]} for p in PROTOCOLS]
    got = call(upstreams, reqs)
    assert got[0]["status"] == 200 and _text("anthropic", False, got[0]["body"]) == "fine"
    assert [g["status"] for g in got[1:]] == [status] * 4
    a, o, r, g = (json.loads(x["body"]) for x in got[1:])
    assert a == {"type": "error", "error": {"type": anthropic_type, "message": f"scripted {status}"}}
    assert o["error"]["code"] == openai_code and r["error"]["code"] == openai_code
    assert o["error"]["message"] == f"scripted {status}"
    assert g["error"] == {"code": status, "message": f"scripted {status}", "status": gemini_status}


def test_a_429_carries_retry_after(upstreams: Upstreams) -> None:
    upstreams.set_script([{"error": {"status": 429, "retry_after": 7}}])
    res = upstreams.run(
        f"curl -sS -D - -o /dev/null --cacert {CA} --data-binary '{{}}' https://model.test/v1/messages"
    )
    assert res.stdout.startswith("HTTP/1.1 429") and "retry-after: 7" in res.stdout.lower()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_malformed_responses_are_broken_where_a_good_one_is_whole(upstreams: Upstreams, stream: bool) -> None:
    upstreams.set_script(
        [
            {"reply": {"text": "whole"}},
            {"malformed": "truncated"},
            {"malformed": "json"},
            {"reply": {"text": "again"}},
        ]
    )
    body = _bodies("anthropic", stream)[0]
    got = call(upstreams, [{"path": "/v1/messages", "body": body}] * 4)
    assert _text("anthropic", stream, got[0]["body"]) == "whole" and got[0]["rc"] == 0
    # Truncated: curl reports the transfer cut short (18 partial file, 56 receive failure).
    assert got[1]["rc"] in (18, 56), got[1]
    if stream:
        assert "message_start" in got[1]["body"] or got[1]["body"] == ""
        names = [n for n, _ in sse(got[2]["body"])]
        assert names[0] == "message_start" and "message_stop" not in names
        with pytest.raises(json.JSONDecodeError):
            [json.loads(d) for _, d in sse(got[2]["body"])]
    else:
        with pytest.raises(json.JSONDecodeError):
            json.loads(got[2]["body"])
    assert got[2]["rc"] == 0 and got[2]["status"] == 200
    assert _text("anthropic", stream, got[3]["body"]) == "again", "the server still answers after both"


def test_a_hang_step_hangs_until_the_client_gives_up(upstreams: Upstreams) -> None:
    upstreams.set_script([{"hang": 6, "reply": {"text": "late"}}, {"reply": {"text": "prompt"}}])
    body = _bodies("openai", False)[0]
    got = call(
        upstreams,
        [
            {"path": "/v1/chat/completions", "body": body, "max_time": 2},
            {"path": "/v1/chat/completions", "body": body, "max_time": 2},
        ],
    )
    assert got[0]["rc"] == 28, got[0]  # curl: operation timed out, nothing answered in 2 s
    assert got[1]["rc"] == 0 and _text("openai", False, got[1]["body"]) == "prompt"
    assert [e["step"] for e in upstreams.requests("model.test")[-2:]] == [0, 1]


def test_the_script_can_be_replaced_from_inside_the_network(upstreams: Upstreams) -> None:
    upstreams.set_script([{"reply": {"text": "from the file"}}])
    script = json.dumps({"steps": [{"reply": {"text": "posted"}}]})
    body = json.dumps(_bodies("anthropic", False)[0])
    res = upstreams.run(
        f"curl -sS --cacert {CA} --data-binary '{script}' https://model.test/_control/script; echo; "
        f"curl -sS --cacert {CA} --data-binary '{body}' https://model.test/v1/messages; echo; "
        f"curl -sS --cacert {CA} https://model.test/_control/state"
    )
    lines = res.stdout.splitlines()
    assert json.loads(lines[0]) == {"steps": 1, "used": []}
    assert _text("anthropic", False, lines[1]) == "posted"
    assert json.loads(lines[2]) == {"steps": 1, "used": [0]}
    assert all(not e["path"].startswith("/_control") for e in upstreams.requests("model.test"))


def test_request_log_records_query_and_bounds_the_body(upstreams: Upstreams) -> None:
    upstreams.set_script([{"protocol": "gemini", "reply": {"text": "hi"}}])
    upstreams.clear_requests("model.test")
    big = {"contents": [{"role": "user", "parts": [{"text": "x" * 100_000}]}]}
    got = call(
        upstreams,
        [
            {
                "path": "/v1beta/models/g:generateContent?key=real-key-123",
                "body": big,
                "headers": {"x-goog-api-key": "k"},
            }
        ],
    )
    assert got[0]["status"] == 200
    (entry,) = upstreams.requests("model.test")
    assert entry["query"] == {"key": ["real-key-123"]} and entry["headers"]["x-goog-api-key"] == "k"
    assert entry["body_truncated"] and len(entry["body"]) == 64 * 1024 and entry["body_bytes"] > 100_000


def test_servers_run_hardened(upstreams: Upstreams, docker_client: docker.DockerClient) -> None:
    for server in upstreams.servers.values():
        attrs = docker_client.containers.get(server.container).attrs
        host = attrs["HostConfig"]
        assert attrs["Config"]["User"] == "65534:65534" and host["ReadonlyRootfs"]
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
        assert list(attrs["NetworkSettings"]["Networks"]) == [upstreams.network]
    net = docker_client.networks.get(upstreams.network).attrs
    assert net["Internal"] and net["Options"]["com.docker.network.bridge.inhibit_ipv4"] == "true"


def test_ca_certificates_verify_with_openssl(tmp_path: Path) -> None:
    from tests.upstreams.ca import make_ca

    ca = make_ca(tmp_path / "ca")
    cert = ca.issue("allowed.test", "*.allowed.test")
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(ca.cert), str(cert.cert)], capture_output=True)
    assert ok.returncode == 0
    other = make_ca(tmp_path / "other")
    bad = subprocess.run(
        ["openssl", "verify", "-CAfile", str(other.cert), str(cert.cert)], capture_output=True
    )
    assert bad.returncode != 0
    sans = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(cert.cert)],
        capture_output=True,
        text=True,
    ).stdout
    assert "DNS:allowed.test" in sans and "DNS:*.allowed.test" in sans
    with pytest.raises(ValueError):
        ca.issue("bad name; rm -rf /")


def test_a_dead_session_is_swept_and_a_live_one_kept(docker_client: docker.DockerClient) -> None:
    from tests.upstreams import fixtures

    images.ensure_image("testnet", DockerBackend(docker_client), progress=lambda s: None)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    made = {}
    for kind, pid in (("dead", gone.pid), ("live", os.getpid())):
        session = f"sweep{kind}{uuid.uuid4().hex[:6]}"
        labels = {LABEL: "upstreams", f"{LABEL}.session": session, f"{LABEL}.pid": str(pid)}
        labels[f"{LABEL}.host"] = socket.gethostname()
        net, _ = create_on_free_subnet(docker_client, f"fila-test-{session}", options={}, labels=labels)
        c = docker_client.containers.run(
            fixtures.IMAGE, ["sleep", "60"], detach=True, network=net.name, labels=labels, **_quiet()
        )
        made[kind] = (net, c)
    try:
        fixtures._sweep_dead_sessions(docker_client)
        names = {n.name for n in docker_client.networks.list(filters={"label": f"{LABEL}=upstreams"})}
        assert made["live"][0].name in names, "a live session is left alone"
        assert made["dead"][0].name not in names
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(made["dead"][1].id)
        assert docker_client.containers.get(made["live"][1].id).status == "running"
    finally:
        for net, c in made.values():
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True)
            with contextlib.suppress(docker.errors.NotFound):
                net.remove()


def _quiet() -> dict[str, Any]:
    return {"user": "65534:65534", "read_only": True, "cap_drop": ["ALL"], "init": True}


def test_an_unreachable_mirror_fails_the_base_build_with_debootstrap_s_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loopback port 9 (discard) answers nothing: debootstrap cannot fetch the Release file.
    monkeypatch.setitem(images.DEBIAN, "mirror", "http://127.0.0.1:9/debian")
    root = tmp_path / "root"
    with pytest.raises(ImageMissing) as info:
        image_bases._debootstrap(root, lambda s: None)
    assert "failed (exit" in str(info.value) and "127.0.0.1:9" in str(info.value)
    assert "Release" in str(info.value), "debootstrap's own reason is kept"
    image_bases._unmount_all(root)  # nothing mounted: the directory can go

"""The gateway's parts on their own (images/gateway/fila_gw): the config check, the destination
check, the meter and the scrubber, and the record, each without mitmproxy or a container. The whole
gateway, with mitmproxy in its image, is tests/test_gateway.py's."""

from __future__ import annotations

import base64
import ipaddress
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

GATEWAY_DIR = Path(__file__).resolve().parents[1] / "images" / "gateway"
KEY = "sk-parts-0123456789abcdef"


@pytest.fixture(scope="module")
def gw() -> Iterator[SimpleNamespace]:
    """The package's modules that need no mitmproxy, imported from the image's source."""
    sys.path.insert(0, str(GATEWAY_DIR))
    try:
        from fila_gw import config, meter, policy, record, scrub

        yield SimpleNamespace(config=config, meter=meter, policy=policy, record=record, scrub=scrub)
    finally:
        sys.path.remove(str(GATEWAY_DIR))
        for name in [m for m in sys.modules if m == "fila_gw" or m.startswith("fila_gw.")]:
            del sys.modules[name]
    assert "mitmproxy" not in sys.modules  # what these parts are: no proxy needed to test them


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_the_config_is_loaded_with_its_keys_and_refused_naming_what_is_wrong(
    gw: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config: ModuleType = gw.config
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "anthropic").write_text(KEY + "\n")
    monkeypatch.setattr(config, "SECRETS_DIR", secrets)
    route = {"upstream": "https://api.anthropic.com", "header": "x-api-key", "secret": "anthropic"}
    good = {"allow": [{"host": "*.example.com", "port": 443}], "routes": {"anthropic": route}}
    got = config.load_config(_write(tmp_path / "good.json", good))
    assert got["routes"]["anthropic"]["key"] == KEY and got["routes"]["anthropic"]["value"] == KEY
    assert got["allow"][0]["host"] == "*.example.com" and got["learn"] is None

    bad = {
        "an IP literal": ({"allow": [{"host": "10.0.0.1", "port": 443}]}, "allow[0].host"),
        "a missing secret": (
            {"routes": {"anthropic": {**route, "secret": "gone"}}},
            "routes.anthropic: cannot read the secret",
        ),
        "a path rule that climbs": (
            {"routes": {"anthropic": {**route, "paths": ["POST /../v1"]}}},
            'is not "METHOD /path"',
        ),
        "learning without a bound": ({"learn": {"ports": [443]}}, "learn needs budget.max_requests"),
        "a negative budget": ({"budget": {"max_tokens": -1}}, "budget.max_tokens"),
    }
    for what, (doc, says) in bad.items():
        with pytest.raises(config.ConfigError) as err:
            config.load_config(_write(tmp_path / "bad.json", doc))
        assert says in str(err.value), (what, str(err.value))


def test_a_basic_credentials_user_password_and_password_are_scrubbed_like_its_base64(
    gw: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `Basic {key}` route's key is the base64 of `user:password`: an answer quoting the decoded
    pair or the password alone is scrubbed as the base64 is. A Bearer key gets no such forms."""
    config: ModuleType = gw.config
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    password = "index-password-77a0"
    token = base64.b64encode(f"corp:{password}".encode()).decode()
    (secrets / "corp").write_text(token)
    monkeypatch.setattr(config, "SECRETS_DIR", secrets)
    corp = {"upstream": "https://pypi.corp.example", "header": "authorization", "secret": "corp",
            "paths": ["GET /**"]}  # fmt: skip
    bearer = config.load_config(
        _write(tmp_path / "b.json", {"routes": {"corp": {**corp, "format": "Bearer {key}"}}})
    )
    assert bearer["routes"]["corp"]["needles"] == [token]  # the counterpart: the key alone
    basic = config.load_config(
        _write(tmp_path / "c.json", {"routes": {"corp": {**corp, "format": "Basic {key}"}}})
    )
    assert basic["routes"]["corp"]["needles"] == [token, f"corp:{password}", password]
    needles = gw.scrub.Needles(basic["routes"]["corp"]["needles"])
    counts: dict[str, int] = {}
    page = f"user corp:{password} / password {password} / token {token} / user corp".encode()
    out = needles.scrub(page, "body", counts)
    assert password.encode() not in out and token.encode() not in out and b"user corp" in out, out
    assert sum(counts.values()) == 3, counts
    short = base64.b64encode(b"corp:short").decode()  # a password under 8 characters: not alone
    assert config.basic_parts("Basic {key}", short) == ["corp:short"]


def test_the_destination_check_refuses_reserved_names_and_private_addresses(gw: SimpleNamespace) -> None:
    policy: ModuleType = gw.policy
    assert policy.host_problem("api.example.com") is None  # the allowed counterpart
    assert policy.host_problem("localhost") == "reserved name"
    assert policy.host_problem("metadata.google.internal") == "reserved name"
    assert policy.host_problem("127.1") == "ip literal" and policy.host_problem("0x7f.1") == "ip literal"
    allow = [{"host": "*.example.com", "port": 443}, {"host": "pypi.org", "port": 443}]
    assert [e["host"] for e in policy.matching_entries(allow, "files.example.com", 443)] == ["*.example.com"]
    assert policy.matching_entries(allow, "example.com", 443) == []  # a wildcard opens only names below it
    assert policy.matching_entries(allow, "pypi.org", 80) == []
    assert policy.address_problem("93.184.216.34", []) is None
    for addr in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "::ffff:192.168.0.1"):
        assert policy.address_problem(addr, []) is not None, addr
    lan = ipaddress.ip_network("10.1.0.0/16")
    assert policy.address_problem("10.1.2.3", [lan]) is None  # opened by allow_private
    host = ipaddress.ip_address("93.184.216.34")
    assert policy.address_problem("93.184.216.34", [], {host}) is not None  # the gateway's host


def test_the_meter_reads_usage_from_whole_and_streamed_answers(gw: SimpleNamespace) -> None:
    meter: ModuleType = gw.meter
    whole = meter.Meter("application/json")
    body = json.dumps({"usage": {"input_tokens": 12, "output_tokens": 30}}).encode()
    assert whole(body[:10]) + whole(body[10:]) + whole(b"") == body  # passed on untouched
    assert whole.usage() == {"input_tokens": 12, "output_tokens": 30}
    sse = meter.Meter("text/event-stream")
    events = (
        b'data: {"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 1}}}\n\n'
        b'data: {"type": "message_delta", "usage": {"output_tokens": 9}}\n\n'
    )
    for i in range(0, len(events), 7):  # split anywhere
        sse(events[i : i + 7])
    sse(b"")
    assert sse.usage() == {"input_tokens": 5, "output_tokens": 9}
    assert meter.Meter("text/html").usage() is None  # no usage read from what is not a model answer


def test_the_scrubber_replaces_every_form_of_the_key_across_chunks(gw: SimpleNamespace) -> None:
    scrub: ModuleType = gw.scrub
    needles = scrub.Needles([KEY])
    counts: dict[str, int] = {}
    plain = b"nothing secret here"
    assert needles.scrub(plain, "body", counts) == plain and counts == {}  # the allowed counterpart
    forms = {
        "": KEY.encode(),
        ":url": "".join(f"%{b:02x}" for b in KEY.encode()).encode(),
        ":base64": base64.b64encode(KEY.encode()),
        ":hex": KEY.encode().hex().encode(),
        ":json": "".join(f"\\u{ord(c):04x}" for c in KEY).encode(),
    }
    for kind, form in forms.items():
        counts = {}
        out = needles.scrub(b"<" + form + b">", "body", counts)
        assert len(out) == len(form) + 2 and form not in out and KEY.encode() not in out, kind
        assert counts == {"body" + kind: 1}, (kind, counts)
    # Split across chunks: the stream holds back what could be the start of a key.
    counts = {}
    stream = scrub.StreamScrubber(needles, counts)
    data = b"before " + KEY.encode() + b" after"
    out = b"".join(stream(data[i : i + 5]) for i in range(0, len(data), 5)) + stream(b"")
    assert len(out) == len(data) and KEY.encode() not in out and out.startswith(b"before ")
    # Split across two event-stream events a client joins.
    counts = {}
    sse = scrub.SseScrubber(needles, counts)
    half = len(KEY) // 2
    parts = (KEY[:half], KEY[half:])
    events = b"".join(b"data: " + json.dumps({"delta": {"text": p}}).encode() + b"\n\n" for p in parts)
    out = sse(events) + sse(b"")
    texts = "".join(
        json.loads(line[6:])["delta"]["text"] for line in out.split(b"\n") if line.startswith(b"data: ")
    )
    assert KEY not in texts and len(texts) == len(KEY) and sum(counts.values()) >= 1


def test_the_record_writes_a_line_per_decision_and_keeps_totals_past_its_cap(
    gw: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record: ModuleType = gw.record
    monkeypatch.setattr(record, "LOG_DIR", tmp_path)
    monkeypatch.setattr(record, "LOG_CAP", 600)

    class Log(record.Recorder):  # the addon's state the record uses
        def __init__(self) -> None:
            self.config = {"learn": None}
            self.requests = self.tokens = self.in_flight = 0
            self.totals = record.new_totals()
            self.needles = gw.scrub.Needles([KEY])
            self._log = (tmp_path / "egress.jsonl").open("a", buffering=1)
            self._log_bytes = 0
            self._summary_at = 0.0

    log = Log()
    log.write(door="proxy", host="pypi.org", port=443, allowed=True, reason=None, status=200)
    log.write(door="proxy", host=f"x.{KEY}.test", port=443, reason="not in allowlist", status=403)
    for _ in range(10):  # past the cap: counted, not written
        log.write(door="dns", host="example.com", reason="the engine resolves no names")
    log._summarize(force=True)
    lines = [json.loads(x) for x in (tmp_path / "egress.jsonl").read_text().splitlines()]
    assert lines[0]["allowed"] is True and lines[0]["host"] == "pypi.org"
    assert lines[1]["allowed"] is False and KEY not in lines[1]["host"]  # scrubbed before it is written
    assert (tmp_path / "egress.jsonl").stat().st_size <= 600
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["allowed"] == 1 and summary["denied"] == 11
    assert sum(summary["suppressed"].values()) == 12 - len(lines)

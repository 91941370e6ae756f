"""Learn, then lock (README): a policy with `egress.learn` lets unlisted public hosts through the
gateway on ports 80 and 443, logged as learned; `fila policy suggest` proposes the smallest
allowlist of what the runs did; the run under that policy reaches all of it and nothing else.

Docker cost (default run): one learning run, one suggest, the rerun (two tasks: the same hosts
with zero denials, then an unlisted one refused), and one stand-alone learning gateway for the
address classes that need a chosen resolution (loopback, link-local, private, the host's own).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from fila.core.errors import InvalidPolicy, InvalidTaskFile
from fila.core.models import AllowEntry, EgressRecord, EgressRequest, ImageRef, Task
from fila.egress import record as egress_record
from fila.egress import suggest as sg
from fila.queue.policy import load_policy
from fila.run.intake import check_task
from tests.support.cli import fila, run_once_console
from tests.support.learn import learning_gateway
from tests.support.project import make_project, make_root, record, shell_task
from tests.upstreams import Upstreams

CURL = "curl -sS --max-time 10 --cacert ca.crt"


def _policy(root: Path, name: str, egress: dict[str, Any], **kw: Any) -> Path:
    """policies/<name>.json, indented (so a diff against it reads line by line)."""
    doc = {
        "network": "allowlist",
        "max_timeout_ms": 120_000,
        "default_timeout_ms": 60_000,
        "grace_ms": 1000,
        "memory": "512m",
        "egress": egress,
    } | kw
    path = root / "policies" / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


# -- never by accident, never without bounds --------------------------------------------------


def test_a_learning_policy_needs_max_requests_and_doctor_lists_it(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    # Allowed: learning with a bound (and no allow entry at all: everything is to be learned).
    _policy(tmp_path, "learn", {"allow": [], "learn": True, "max_requests": 100})
    policy, _ = load_policy(root, "learn")
    assert policy.egress is not None and policy.egress.learn and policy.egress.max_requests == 100
    _policy(tmp_path, "unbounded", {"allow": [], "learn": True})
    with pytest.raises(InvalidPolicy) as e:
        load_policy(root, "unbounded")
    assert "egress.max_requests" in str(e.value) and "learn" in str(e.value)
    (tmp_path / "policies" / "unbounded.json").unlink()
    # A task cannot turn learning on: it has no egress field at all.
    with pytest.raises(ValueError, match="egress"):
        Task.model_validate({"engine": "shell", "targets": ["a"], "egress": {"learn": True}})
    res = fila(tmp_path, "doctor", "--no-self-test", "--json")
    (pol,) = [c for c in json.loads(res.stdout)["checks"] if c["name"] == "policies"]
    assert pol["ok"] and pol["data"]["learning"] == ["learn (max_requests 100)"], pol
    assert "LEARNING" in pol["detail"]


def test_one_engine_learns_at_a_time_no_compare_group_no_fallback_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_project(tmp_path)
    monkeypatch.setenv("FILA_TEST_LEARN_KEY", "sk-test")
    egress = {
        "allow": [{"host": "allowed.test"}],
        "routes": {"anthropic": {"credential": "FILA_TEST_LEARN_KEY"}},
        "max_requests": 10,
    }
    _policy(tmp_path, "locked", egress, fallback=["claude"])
    _policy(tmp_path, "learn", egress | {"learn": True}, fallback=["claude"])
    for field, kw in (("group", {"group": "g1", "fallback": []}), ("fallback", {})):
        # Allowed counterpart: the same task under the same policy without learning.
        check_task(root, shell_task(policy="locked", prompt="hi", **kw))
        with pytest.raises(InvalidTaskFile) as e:
            check_task(root, shell_task(policy="learn", prompt="hi", **kw))
        assert "one engine learns at a time" in e.value.message and e.value.to_dict()["exit_code"] == 2
        assert field in e.value.message
    # One engine, no fallback: a learning policy runs it.
    check_task(root, shell_task(policy="learn", prompt="hi", fallback=[]))


# -- suggest, as pure functions over what gateways logged ------------------------------------


def _rec(*lines: tuple[str, str, int, bool], learning: bool = True) -> EgressRecord:
    reqs = [
        EgressRequest(door="proxy", method=m, host=h, port=p, allowed=True, learned=learned)
        for m, h, p, learned in lines
    ]
    return EgressRecord(requests=reqs, learning=learning)


def test_suggest_lists_exact_hosts_methods_for_plain_http_and_wildcards_only_when_asked() -> None:
    recs = [
        _rec(("CONNECT", "a.pkg.example.org", 443, True), ("GET", "mirror.example.org", 80, True)),
        _rec(("CONNECT", "b.pkg.example.org", 443, True), ("HEAD", "mirror.example.org", 80, True)),
        _rec(("CONNECT", "api.example.com", 443, False), ("CONNECT", "x.example.com", 8443, False)),
    ]
    # A denied line is not something the run did.
    recs[2].requests.append(EgressRequest(door="proxy", method="CONNECT", host="evil.test", port=443))
    used = sg.used_hosts(recs)
    assert sg.entries_for(used) == [
        {"host": "mirror.example.org", "port": 80, "methods": ["GET", "HEAD"]},
        {"host": "a.pkg.example.org", "port": 443},
        {"host": "api.example.com", "port": 443},
        {"host": "b.pkg.example.org", "port": 443},
        {"host": "x.example.com", "port": 8443},
    ]
    # Two names below pkg.example.org (a name the policy lists) become one entry; one name below
    # example.com stays exact, and no entry is ever a bare `*.com`-like suffix.
    assert sg.entries_for(used, wildcards=True, listed={"pkg.example.org"}) == [
        {"host": "mirror.example.org", "port": 80, "methods": ["GET", "HEAD"]},
        {"host": "*.pkg.example.org", "port": 443},
        {"host": "api.example.com", "port": 443},
        {"host": "x.example.com", "port": 8443},
    ]
    policy_doc = {
        "egress": {
            "allow": [
                {"host": "api.example.com"},
                {"host": "old.example.com"},
                {"host": "*.pkg.example.org"},
            ],
            "routes": {"anthropic": {"credential": "K"}},
            "learn": True,
            "max_requests": 5,
        }
    }
    assert sg.unused_entries(policy_doc, used, recs) == [
        "egress.allow.1 old.example.com:443",
        "egress.routes.anthropic",
    ]
    locked = sg.locked_document(policy_doc, sg.entries_for(used))
    assert "learn" not in locked["egress"] and locked["egress"]["max_requests"] == 5
    assert "learn" in policy_doc["egress"]  # the document given is left as it was
    assert sg.covers(
        AllowEntry(host="*.pkg.example.org"), "a.pkg.example.org", 443, used[("a.pkg.example.org", 443)]
    )


def test_suggest_widens_only_a_suffix_the_runs_used_or_the_policy_lists_and_leaves_out_odd_methods() -> None:
    recs = [
        _rec(
            ("CONNECT", "a.corp.example", 443, True),
            ("CONNECT", "b.corp.example", 443, True),
            ("CONNECT", "corp.example", 443, True),
            ("CONNECT", "attacker1.github.io", 443, True),
            ("CONNECT", "attacker2.github.io", 443, True),
            ("CONNECT", "x.co.uk", 443, True),
            ("CONNECT", "y.co.uk", 443, True),
            ("GET", "mirror.example.org", 80, True),
            ("M-SEARCH", "mirror.example.org", 80, True),
            ("get", "odd.example.org", 80, True),
        )
    ]
    used = sg.used_hosts(recs)
    # Allowed: corp.example is itself a name the run used, so the names below it may become one.
    # Never: github.io and co.uk, suffixes only the engine chose (anyone registers names there).
    assert sg.entries_for(used, wildcards=True) == [
        {"host": "mirror.example.org", "port": 80, "methods": ["GET"]},
        {"host": "*.corp.example", "port": 443},
        {"host": "attacker1.github.io", "port": 443},
        {"host": "attacker2.github.io", "port": 443},
        {"host": "corp.example", "port": 443},
        {"host": "x.co.uk", "port": 443},
        {"host": "y.co.uk", "port": 443},
    ]
    # ... unless the policy lists the suffix: the operator widens their own domain.
    doc = {"egress": {"allow": [{"host": "github.io"}], "learn": True, "max_requests": 5}}
    assert {"host": "*.github.io", "port": 443} in sg.entries_for(
        used, wildcards=True, listed=sg.listed_names(doc)
    )
    # A method a policy cannot list (the proxy door passes any) is left out and named; a host:port
    # used only with such methods gets no entry (without methods it would open every method).
    assert sg.method_notes(used) == [
        "mirror.example.org:80: methods left out (a policy lists ^[A-Z]{1,16}$ only): M-SEARCH",
        "odd.example.org:80 left out: used only with methods a policy cannot list (get)",
    ]
    from fila.queue.policy import validate_document

    validate_document("policy", sg.locked_document(_LOCKABLE, sg.entries_for(used)), path="suggestion")


_LOCKABLE = {
    "network": "allowlist",
    "max_timeout_ms": 1000,
    "default_timeout_ms": 1000,
    "egress": {"allow": [], "learn": True, "max_requests": 5},
}


def test_suggest_write_never_shadows_a_shipped_policy_nor_writes_through_a_planted_link(
    tmp_path: Path,
) -> None:
    from fila.core.errors import Refused
    from fila.queue.policy import Suggestion, write_suggested

    root = make_root(tmp_path)
    for p in root.policies_dir.glob("*.json"):
        p.unlink()  # the shipped policies are missing from this root: a NAME would shadow one
    s = Suggestion("learn", tmp_path / "x", "", '{"new": true}\n', [], [], [], [])
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (root.policies_dir / ".locked.json.tmp").symlink_to(victim)
    # Allowed: a new name, written as a new file (the link at the temporary name is not followed).
    assert write_suggested(root, "locked", s).read_text() == '{"new": true}\n'
    assert victim.read_text() == "keep\n" and not (root.policies_dir / ".locked.json.tmp").exists()
    with pytest.raises(Refused, match="shipped policy"):
        write_suggested(root, "default", s)
    assert not (root.policies_dir / "default.json").exists()
    assert write_suggested(root, "default", s, force=True).read_text() == '{"new": true}\n'


def _suggested(tmp_path: Path, text: str) -> tuple[list[str], dict[str, Any]]:
    """`fila policy suggest`'s diff for one run that used api.example.com:443 under the policy
    `text`, checked with `git apply --check` in a repository holding that file, then applied: the
    diff's lines, and the policy the applied diff leaves."""
    import hashlib
    import subprocess

    from fila.core.models import PolicyRef, Record
    from fila.queue import policy

    root = make_root(tmp_path / "root")
    (root.policies_dir / "hand.json").write_text(text)
    run = Record(
        id="t1",
        status="needs_review",
        policy=PolicyRef(name="hand", sha256=hashlib.sha256(text.encode()).hexdigest()),
        egress=_rec(("CONNECT", "api.example.com", 443, True)),
    )
    diff = policy.suggest(root, [run]).diff()
    repo = tmp_path / "repo"
    (repo / "policies").mkdir(parents=True)
    (repo / "policies" / "hand.json").write_text(text)
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    check = subprocess.run([*git, "apply", "--check", "-"], input=diff, capture_output=True, text=True)
    assert check.returncode == 0, (check.stderr, diff)
    subprocess.run([*git, "apply", "-"], input=diff, check=True, text=True)
    return diff.splitlines(), json.loads((repo / "policies" / "hand.json").read_text())


def test_suggest_diff_applies_without_a_final_newline_and_shows_only_the_allowlist_change(
    tmp_path: Path,
) -> None:
    # A policy written by json.dump(indent=2): no final newline. The diff says so, as git does.
    lines, applied = _suggested(tmp_path / "a", json.dumps(_LOCKABLE, indent=2))
    assert applied == _LOCKABLE | {
        "egress": {"allow": [{"host": "api.example.com", "port": 443}], "max_requests": 5}
    }
    assert lines[-2:] == [" }", "\\ No newline at end of file"], lines

    # A hand-formatted policy, as the shipped default.json is (its `deny` on few lines): the
    # diff removes the old allowlist and `learn` and adds the new allowlist, nothing else.
    shipped = (Path(__file__).parents[1] / "policies" / "default.json").read_text()
    hand = shipped.replace('"network": "none",', '"network": "allowlist",').replace(
        '  "projects": []\n',
        '  "projects": [],\n  "egress": {\n    "allow": [{"host": "old.example", "port": 443}],\n'
        '    "learn": true,\n    "max_requests": 50\n  }\n',
    )
    assert hand != shipped and json.loads(hand)["egress"]["learn"] is True
    lines, applied = _suggested(tmp_path / "b", hand)
    removed = [ln for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    added = [ln[1:] for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
    assert removed == ['-    "allow": [{"host": "old.example", "port": 443}],', '-    "learn": true,'], lines
    assert json.loads("{" + "".join(added).rstrip(",") + "}") == {
        "allow": [{"host": "api.example.com", "port": 443}]
    }, lines
    assert applied == json.loads(hand) | {
        "egress": {"allow": [{"host": "api.example.com", "port": 443}], "max_requests": 50}
    }


def test_the_gateway_refuses_the_names_the_policy_refuses() -> None:
    # The lists are read from the source (the gateway runs in its own image).
    import ast

    wanted = {"RESERVED_NAMES", "RESERVED_SUFFIXES", "_PRIVATE_NAMES", "_PRIVATE_SUFFIXES"}

    def consts(path: Path) -> dict[str, Any]:
        tree = ast.parse(path.read_text())
        return {
            t.id: ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name) and t.id in wanted
        }

    src = Path(__file__).resolve().parents[1]
    gw = consts(src / "images" / "gateway" / "fila_gw" / "policy.py")
    pol = consts(src / "src" / "fila" / "egress" / "config.py")
    assert set(gw["RESERVED_NAMES"]) == set(pol["_PRIVATE_NAMES"]) and "metadata.goog" in gw["RESERVED_NAMES"]
    assert (
        set(gw["RESERVED_SUFFIXES"]) == set(pol["_PRIVATE_SUFFIXES"]) and ".arpa" in gw["RESERVED_SUFFIXES"]
    )


def test_the_record_says_the_run_was_learning_and_lists_what_it_learned(tmp_path: Path) -> None:
    log = tmp_path / "egress.jsonl"
    lines = [
        {"door": "proxy", "method": "CONNECT", "host": "listed.example", "port": 443, "allowed": True},
        {
            "door": "proxy",
            "method": "CONNECT",
            "host": "new.example",
            "port": 443,
            "allowed": True,
            "learned": True,
        },
        {"door": "proxy", "method": "CONNECT", "host": "10.0.0.1", "port": 443, "reason": "ip literal"},
    ]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "summary.json").write_text(json.dumps({"allowed": 2, "denied": 1, "learning": True}))
    rec = egress_record.read_log(log, summary=tmp_path / "summary.json")
    assert rec.learning and rec.learned == ["new.example:443"]
    text = "\n".join(egress_record.lines(rec))
    assert "learning  the policy was learning" in text and "learned: new.example:443" in text
    assert "CONNECT new.example:443 - LEARNED" in text and "listed.example:443 - allowed" in text
    (msg,) = egress_record.learning_messages(rec)
    assert "new.example:443" in msg and "fila policy suggest" in msg
    # Not learning: nothing said.
    plain = egress_record.read_log(log)
    assert not plain.learning and egress_record.learning_messages(plain) == []
    # Learned nothing: said so when the log was read whole, never when lines were dropped.
    log.write_text(json.dumps(lines[0]) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"allowed": 1, "denied": 0, "learning": True}))
    whole = egress_record.read_log(log, summary=tmp_path / "summary.json")
    assert "learned: nothing beyond the allowlist" in egress_record.learning_messages(whole)[0]
    assert "learned: nothing" in "\n".join(egress_record.lines(whole))
    suppressed = {"allowed": 1, "denied": 9000, "learning": True, "suppressed": {"dns denied: x": 9000}}
    (tmp_path / "summary.json").write_text(json.dumps(suppressed))
    cut = egress_record.read_log(log, summary=tmp_path / "summary.json")
    (msg,) = egress_record.learning_messages(cut)
    assert "learned: incomplete: 9000 log lines dropped" in msg and "nothing" not in msg
    assert "learned: incomplete: 9000 log lines dropped" in "\n".join(egress_record.lines(cut))


# -- on real Docker ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def testnet(
    docker_client: docker.DockerClient, gateway_image: str, upstreams: Upstreams
) -> Iterator[ImageRef]:
    from fila.sandbox.docker.backend import DockerBackend
    from fila.sandbox.images import ensure_image

    yield ensure_image("testnet", DockerBackend(docker_client), progress=lambda _l: None)
    # Learning reaches denied.test on purpose; tests/test_gateway.py asserts that nothing reached it
    # in its session: its request log is emptied once this module is done.
    upstreams.clear_requests("denied.test")


def _submit(root: Path, policy: str, command: str) -> str:
    task = {"engine": "shell", "command": command, "targets": ["greeting.txt", "ca.crt"], "policy": policy,
            "image": "fila/testnet:latest", "fallback": []}  # fmt: skip
    (root / "task.json").write_text(json.dumps(task))
    res = fila(root, "submit", str(root / "task.json"))
    assert res.exit_code == 0, res.output
    return res.stdout.strip()


def _answers(root: Path, tid: str) -> dict[str, str]:
    log = (root / record(root, tid)["log_path"]).read_text()
    return dict(line.split(": ", 1) for line in log.splitlines() if ": " in line)


# What the task does with the hosts it uses: two listed (TLS), one unlisted on 443 and on plain 80.
USES = (
    f'echo "listed: $({CURL} https://allowed.test/ 2>&1)"; '
    f'echo "listed2: $({CURL} https://other.allowed.test/ 2>&1)"; '
    f'echo "unlisted: $({CURL} https://denied.test/ 2>&1)"; '
    'echo "unlisted80: $(curl -sS --max-time 10 http://denied.test/ 2>&1)"; '
)


def _code(label: str, url: str) -> str:
    return f'echo "{label}: $({CURL} -o /dev/null -w "%{{http_connect}}" {url} 2>/dev/null)"; '


@pytest.mark.docker
@pytest.mark.quick
def test_learn_then_lock_suggest_proposes_exactly_the_hosts_used_and_the_locked_rerun_refuses_others(
    tmp_path: Path, upstreams: Upstreams, testnet: ImageRef, docker_client: docker.DockerClient
) -> None:
    make_project(tmp_path)
    shutil.copyfile(upstreams.ca_file, tmp_path / "ca.crt")
    ip = {h: upstreams.ip(h) for h in ("allowed.test", "other.allowed.test", "denied.test")}
    egress = {
        "allow": [
            {"host": "allowed.test", "port": 443},
            {"host": "other.allowed.test", "port": 443},
            {"host": "unused.example", "port": 443},
        ],
        # The three static servers, each its own /32: model.test, on the same subnet, stays private.
        "allow_private": [f"{a}/32" for a in ip.values()],
        "egress_network": upstreams.network,
        "learn": True,
        "max_requests": 20,
    }
    _policy(tmp_path, "learn", egress)
    never = (
        _code("other port", "https://denied.test:8443/")  # learning opens 80 and 443 only
        + _code("ip literal", f"https://{ip['denied.test']}/")
        + _code("private", "https://model.test/")
        + _code("metadata", "https://metadata.google.internal/")
        + 'echo "dns: $(getent hosts denied.test || echo none)"'
    )
    tid = _submit(tmp_path, "learn", USES + never)
    res = run_once_console(tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr
    got = _answers(tmp_path, tid)
    # Allowed first: the listed hosts, and the unlisted one let through because the policy learns.
    assert got["listed"] == "hello from allowed.test" and got["listed2"] == "hello from other.allowed.test"
    assert got["unlisted"] == "hello from denied.test" and got["unlisted80"] == "hello from denied.test"
    # Never allowed, learning or not: the gateway's own checks refused each.
    assert [got[k] for k in ("other port", "ip literal", "private", "metadata")] == ["403"] * 4, got
    assert got["dns"] == "none"
    rec = record(tmp_path, tid)
    eg = rec["egress"]
    assert eg["learning"] is True and sorted(eg["learned"]) == ["denied.test:443", "denied.test:80"], eg
    reasons = {
        (r["host"], r["port"]): r["reason"]
        for r in eg["requests"]
        if not r["allowed"] and r["door"] == "proxy"
    }
    assert reasons == {
        ("denied.test", 8443): "not in allowlist",
        (ip["denied.test"], 443): "ip literal",
        ("model.test", 443): f"private address {upstreams.ip('model.test')}",
        ("metadata.google.internal", 443): "reserved name",
    }, reasons
    assert any(r["door"] == "dns" and not r["allowed"] for r in eg["requests"])
    assert not any(
        r["learned"] for r in eg["requests"] if r["host"] in ("allowed.test", "other.allowed.test")
    )
    # Said plainly in the record, `fila show`, `fila review` and REVIEW.html.
    assert any("the policy was learning" in w and "denied.test:443" in w for w in rec["warnings"]), rec[
        "warnings"
    ]
    show = fila(tmp_path, "show", tid).stdout
    review = fila(tmp_path, "review", tid, "--no-pager").stdout
    html = Path(fila(tmp_path, "review", tid, "--html").stdout.strip()).read_text()
    for text in (show, review, html):
        assert "the policy was learning" in text and "denied.test:80" in text

    # Suggest: exactly the hosts used (listed or learned), methods for the plain-HTTP one; the
    # listed entry no run used is named; learning is off in the proposal.
    out = fila(tmp_path, "policy", "suggest", tid, "--write", "locked", "--json")
    assert out.exit_code == 0, out.output
    s = json.loads(out.stdout)
    assert s["allow"] == [
        {"host": "denied.test", "port": 80, "methods": ["GET"]},
        {"host": "allowed.test", "port": 443},
        {"host": "denied.test", "port": 443},
        {"host": "other.allowed.test", "port": 443},
    ]
    assert s["unused"] == ["egress.allow.2 unused.example:443"] and sorted(s["learned"]) == sorted(
        eg["learned"]
    )
    diff = s["diff"].splitlines()
    assert diff[:2] == ["--- a/policies/learn.json", "+++ b/policies/locked.json"]
    assert '-    "learn": true,' in diff and '-        "host": "unused.example",' in diff, s["diff"]
    assert '+        "host": "denied.test",' in diff
    locked = json.loads((tmp_path / "policies" / "locked.json").read_text())
    assert "learn" not in locked["egress"] and locked["egress"]["allow"] == s["allow"]
    txt = fila(tmp_path, "policy", "suggest", tid)  # the text form: the diff, then what was unused
    assert (
        txt.exit_code == 0
        and txt.stdout.splitlines() == s["diff"].replace("locked.json", "learn.json").splitlines()
    )
    assert "unused: egress.allow.2 unused.example:443 (no run in the set used it)" in txt.output
    # Never over an existing policy without --force.
    again = fila(tmp_path, "policy", "suggest", tid, "--write", "locked")
    assert again.exit_code == 4 and "exists already" in again.output

    # Lock: the same hosts under the suggested policy, zero denials; then an unlisted one, refused.
    same = _submit(tmp_path, "locked", USES)
    other = _submit(
        tmp_path,
        "locked",
        f'echo "listed: $({CURL} https://allowed.test/ 2>&1)"; ' + _code("new", "https://model.test/"),
    )
    res = run_once_console(tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr
    got = _answers(tmp_path, same)
    assert [got[k] for k in ("listed", "listed2", "unlisted", "unlisted80")] == [
        "hello from allowed.test",
        "hello from other.allowed.test",
        "hello from denied.test",
        "hello from denied.test",
    ]
    eg = record(tmp_path, same)["egress"]
    assert eg["denied"] == 0 and eg["learning"] is False and eg["learned"] == [], eg
    got = _answers(tmp_path, other)
    assert got["listed"] == "hello from allowed.test" and got["new"] == "403", got
    (refused,) = [r for r in record(tmp_path, other)["egress"]["requests"] if not r["allowed"]]
    assert (refused["host"], refused["reason"]) == ("model.test", "not in allowlist")


@pytest.mark.docker
def test_every_never_allowed_address_class_stays_refused_while_learning(
    tmp_path: Path, upstreams: Upstreams, testnet: ImageRef, docker_client: docker.DockerClient
) -> None:
    host_ip = upstreams.ip("other.allowed.test")  # stands in for an address of the gateway's host
    names = {
        "loop.learn.test": "127.0.0.1",
        "loop6.learn.test": "::1",
        "meta.learn.test": "169.254.169.254",
        "lan.learn.test": "192.168.77.7",
        "self.learn.test": host_ip,
    }
    with learning_gateway(
        docker_client,
        upstreams,
        tmp_path,
        allow=[{"host": "allowed.test", "port": 443}],
        allow_private=[upstreams.subnet],
        host_addresses=[host_ip],
        # /etc/hosts entries for the absolute names the gateway looks up (`resolve` adds the dot).
        extra_hosts={f"{n}.": a for n, a in names.items()},
        # Every unlisted name costs one request before it is looked up, refused or not: the two
        # learned requests, the five names, the plain-HTTP refusal below.
        max_requests=8,
    ) as gw:
        c = "curl -sS --max-time 10 --cacert /etc/fila-test/ca.crt"

        def code(label: str, url: str) -> str:
            return f'echo "{label}: $({c} -o /dev/null -w "%{{http_connect}}" {url} 2>/dev/null)"; '

        script = (
            # Allowed first: a listed host, and an unlisted public-enough one learned (1 of 8).
            f'echo "listed: $({c} https://allowed.test/ 2>&1)"; '
            f'echo "learned: $({c} https://denied.test/ 2>&1)"; '
            + "".join(
                f'echo "{n}: $({c} -o /dev/null -w "%{{http_connect}}" https://{n}/ 2>/dev/null)"; '
                for n in names
            )
            # A refused name's answer says no more than that: the address is the log's only.
            + 'echo "lan body: $(curl -s --max-time 10 http://lan.learn.test/)"; '
            + code("literal", f"https://{upstreams.ip('denied.test')}/")
            + code("localhost", "https://localhost/")
            + code("policy-private", "https://metadata.goog/")
            # The bound: a last learned request (8 of 8), then the next is refused, and a name that
            # does not resolve is refused as well without being looked up; listed still passes.
            + 'echo "learned80: $(curl -sS --max-time 10 http://denied.test/ 2>&1)"; '
            + code("past budget", "https://denied.test/")
            + code("past budget unresolved", "https://nowhere.learn.test/")
            + f'echo "listed again: $({c} https://allowed.test/ 2>&1)"'
        )
        res = upstreams.run(script, env={"https_proxy": gw.proxy, "http_proxy": gw.proxy}, timeout=120)
        assert res.exit_code == 0, res.stderr
        got = dict(line.split(": ", 1) for line in res.stdout.splitlines() if ": " in line)
        assert got["listed"] == "hello from allowed.test" and got["learned"] == "hello from denied.test", got
        assert (
            got["learned80"] == "hello from denied.test" and got["listed again"] == "hello from allowed.test"
        )
        assert [got[n] for n in names] == ["403"] * len(names), got
        assert got["literal"] == got["localhost"] == got["policy-private"] == "403", got
        assert got["past budget"] == got["past budget unresolved"] == "429", got
        assert json.loads(got["lan body"])["error"]["message"] == "destination refused", got
        log = gw.log()
        reasons = {e["host"]: e["reason"] for e in log if not e["allowed"] and e["method"] == "CONNECT"}
        assert reasons == {
            "loop.learn.test": "loopback address 127.0.0.1",
            "loop6.learn.test": "loopback address ::1",
            "meta.learn.test": "link-local address 169.254.169.254",
            "lan.learn.test": "private address 192.168.77.7",
            "self.learn.test": f"address of the gateway's host {host_ip}",
            upstreams.ip("denied.test"): "ip literal",
            "localhost": "reserved name",
            "metadata.goog": "reserved name",
            "denied.test": "learning budget max_requests spent",
            "nowhere.learn.test": "learning budget max_requests spent",
        }, reasons
        (lan,) = [e for e in log if e["method"] == "GET" and e["host"] == "lan.learn.test"]
        assert (lan["status"], lan["reason"]) == (403, "private address 192.168.77.7"), lan
        learned = [(e["host"], e["port"]) for e in log if e["allowed"] and e.get("learned")]
        assert learned == [("denied.test", 443), ("denied.test", 80)], log
        assert not any(e.get("learned") for e in log if e["host"] == "allowed.test")


@pytest.mark.docker
def test_learned_requests_are_logged_past_the_log_cap_and_the_record_says_what_was_dropped(
    tmp_path: Path, upstreams: Upstreams, testnet: ImageRef, docker_client: docker.DockerClient
) -> None:
    # A flood of refusals (free for the engine) fills egress.jsonl to its cap: what the engine
    # learned after it must still be written, and the record must not say the list is whole.
    with learning_gateway(
        docker_client,
        upstreams,
        tmp_path,
        allow=[],
        allow_private=[upstreams.subnet],
        host_addresses=[],
        extra_hosts={},
        max_requests=5,
        log_cap=3000,
    ) as gw:
        c = "curl -s --max-time 10 --cacert /etc/fila-test/ca.crt"
        script = (
            f'echo "before: $({c} https://denied.test/)"; '
            f"for i in $(seq 25); do {c} -o /dev/null http://10.9.9.9/flood; done; "
            f'echo "after: $({c} https://denied.test/)"; '
            f'echo "after80: $({c} http://denied.test/)"; '
            # Past the half second the gateway waits between summaries: the last denial writes it.
            f"sleep 0.6; {c} -o /dev/null http://10.9.9.9/last"
        )
        res = upstreams.run(script, env={"https_proxy": gw.proxy, "http_proxy": gw.proxy}, timeout=120)
        assert res.exit_code == 0, res.stderr
        got = dict(line.split(": ", 1) for line in res.stdout.splitlines() if ": " in line)
        assert got == {k: "hello from denied.test" for k in ("before", "after", "after80")}, got
        log = gw.log()
        # Allowed counterpart: the learned request before the flood, under the cap; then the cap
        # held for the refusals, and the learned ones after it were written all the same.
        assert (log[0]["host"], log[0].get("learned")) == ("denied.test", True), log[0]
        assert (
            sum(1 for e in log if not e["allowed"]) < 25
            and (gw.log_dir / "egress.jsonl").stat().st_size <= 3000 + 3000 // 4
        )
        learned = [(e["host"], e["port"]) for e in log if e.get("learned")]
        assert learned == [("denied.test", 443), ("denied.test", 443), ("denied.test", 80)], log
        rec = egress_record.read_log(gw.log_dir / "egress.jsonl", summary=gw.log_dir / "summary.json")
        assert rec.learning and rec.learned == ["denied.test:443", "denied.test:80"] and rec.dropped > 0
        text = "\n".join(egress_record.lines(rec))
        assert (
            f"learned: denied.test:443, denied.test:80 (incomplete: {rec.dropped} log lines dropped)" in text
        )


def test_suggest_setup_locks_the_environments_allowlist_from_what_its_setup_learned(tmp_path: Path) -> None:
    """Learn, then lock, for a project environment's setup (docs/environments.md): the hosts its
    setup's gateway let through become the policy's `environment.allow`, learning off, the
    engine's `egress` untouched; a run that built no environment has nothing to read."""
    import hashlib
    import subprocess

    from fila.core.errors import InvalidPolicy
    from fila.core.models import EnvironmentRecord, PolicyRef, Record
    from fila.queue import policy

    doc = {**_LOCKABLE, "environment": {"learn": True, "max_requests": 50, "timeout_ms": 60_000}}
    text = json.dumps(doc, indent=2) + "\n"
    root = make_root(tmp_path / "root")
    (root.policies_dir / "hand.json").write_text(text)
    ref = PolicyRef(name="hand", sha256=hashlib.sha256(text.encode()).hexdigest())
    learned = _rec(("CONNECT", "pypi.org", 443, True), ("CONNECT", "files.pythonhosted.org", 443, True))
    env = EnvironmentRecord(
        key="k" * 64, source="fila-environment.json", form="fila", how="built", egress=learned
    )
    run = Record(id="t1", status="needs_review", policy=ref, environment=env)
    s = policy.suggest(root, [run], setup=True)
    repo = tmp_path / "repo"
    (repo / "policies").mkdir(parents=True)
    (repo / "policies" / "hand.json").write_text(text)
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo), "apply", "-"], input=s.diff(), check=True, text=True)
    applied = json.loads((repo / "policies" / "hand.json").read_text())
    assert applied["environment"] == {
        "allow": [{"host": "files.pythonhosted.org", "port": 443}, {"host": "pypi.org", "port": 443}],
        "max_requests": 50,
        "timeout_ms": 60_000,
    }
    assert applied["egress"] == doc["egress"] and sorted(s.learned) == [
        "files.pythonhosted.org:443",
        "pypi.org:443",
    ]
    no_env = Record(id="t2", status="needs_review", policy=ref, egress=learned)
    assert policy.suggest(root, [no_env]).allow  # the engine's own egress: the allowed counterpart
    with pytest.raises(InvalidPolicy, match="no setup gateway record for t2"):
        policy.suggest(root, [no_env], setup=True)

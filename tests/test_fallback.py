"""Quota fallback: on `quota` the next engine runs on a fresh work/, every
attempt is in the record; the job's egress budget, `auth` and `engine_error` never fall back. Bad
input (an unknown fallback engine, one the policy's images or routes do not allow) is refused at
submit, exit 2, naming the field.

The end-to-end test runs the real claude CLI in its image through the egress gateway against the
scripted model server (tests/upstreams/README.md), falling back to the real shell engine.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from pathlib import Path
from typing import Any

import docker
import pytest

from fila.core.models import Policy, Task
from fila.run.intake import fallback_chain
from fila.sandbox.docker.backend import DockerBackend
from tests.support.cli import fila, run_once_console
from tests.support.marks import matrix_beyond
from tests.support.policy import model_policy, model_route, write_policy
from tests.support.project import make_root, record
from tests.upstreams import Upstreams

KEY_VAR = "FILA_TEST_FALLBACK_KEY"
WRITE = {"name": "Write", "arguments": {"file_path": "/job/work/hello.txt", "content": "from claude\n"}}
RATE = "Number of request tokens has exceeded your per-minute rate limit"


def _policy(root: Path, ups: Upstreams, name: str, **extra: Any) -> None:
    route = model_route(ups, KEY_VAR)
    write_policy(root, name, model_policy(ups, {"anthropic": route, "openai": route}, **extra))


def _submit(root: Path, *args: str) -> str:
    res = fila(root, "submit", "--target", "a.txt", *args, env={KEY_VAR: "sk-test-submit"})
    assert res.exit_code == 0, res.output
    return res.stdout.strip()


def _run_once(root: Path, secret: str) -> subprocess.CompletedProcess[str]:
    return run_once_console(root, {KEY_VAR: secret}, timeout=600)


def _log(root: Path, rel: str | None) -> str:
    return (root / rel).read_text(errors="replace") if rel else ""


def _engines_root(path: Path, client: docker.DockerClient, engines: tuple[str, ...]) -> None:
    """A queue root with a.txt, the engines' images built when missing."""
    from fila.sandbox.images import ensure_image

    for engine in engines:
        ensure_image(engine, DockerBackend(client), progress=lambda _l: None)
    make_root(path)
    (path / "a.txt").write_text("hello\n")


@pytest.fixture
def fb_root(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    gateway_image: str,
) -> Path:
    _engines_root(tmp_path, docker_client, ("claude", "codex", "shell"))
    _policy(tmp_path, upstreams, "chain", fallback=["shell"])  # the policy's default chain
    _policy(tmp_path, upstreams, "budget", fallback=["shell"], egress={"max_requests": 1})
    return tmp_path


@pytest.mark.docker
@pytest.mark.engines
def test_quota_falls_back_on_a_fresh_work_dir_and_budget_auth_and_engine_error_never_do(
    fb_root: Path,
    upstreams: Upstreams,
) -> None:
    root, secret = fb_root, f"sk-test-{secrets.token_hex(16)}"
    shell_cmd = ("--command", "echo from shell >> a.txt")
    prompt = ("--prompt", "Create hello.txt.")

    # ALLOWED: claude writes hello.txt, then its model route answers 429 until the CLI gives up:
    # quota, so the policy's chain runs shell, on a fresh copy (claude's hello.txt is gone).
    upstreams.set_script(
        [
            {"protocol": "anthropic", "when": "no_tool_result", "reply": {"tool": WRITE}},
            *[{"protocol": "anthropic", "error": {"status": 429, "message": RATE, "retry_after": 0}}] * 12,
        ]
    )
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "claude", *prompt, *shell_cmd, "--policy", "chain")
    done = _run_once(root, secret)
    rec = record(root, tid)
    assert rec["status"] == "needs_review", (rec["error"], done.stderr[-2000:])
    assert rec["engine"] == "shell" and rec["image"]["tag"] == "fila/shell:latest"
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [
        ("claude", "quota"),
        ("shell", "success"),
    ]
    first = rec["attempts"][0]
    assert first["error"]["kind"] == "quota"
    assert first["image"]["tag"] == "fila/claude:latest" and first["image"]["id"].startswith("sha256:")
    assert first["exit_code"] not in (0, None)
    # The model server really answered the CLI 429, and the gateway measured it for that attempt.
    got = upstreams.requests("model.test")
    assert got and got[0]["status"] == 200 and {r["status"] for r in got[1:]} == {429}
    assert first["egress"]["routes"]["anthropic"]["statuses"].get("429", 0) >= 1
    # Each engine's log is its own: claude's kept aside, shell's where the record points.
    assert first["log_path"] != rec["log_path"] and (root / first["log_path"]).is_file()
    assert first["log_path"] in first["error"]["message"] or "429" in first["error"]["message"]
    patch = (root / rec["patch_path"]).read_text()
    assert "+from shell" in patch
    assert "hello.txt" not in patch, "the fallback saw the first engine's work/"
    assert rec["diffstat"]["paths"] == ["a.txt"]
    # Each attempt numbered, with its own outcome, exit code, image, log and egress (show and review).
    assert [a["number"] for a in rec["attempts"]] == [1, 2] and {a["run"] for a in rec["attempts"]} == {1}
    last = rec["attempts"][1]
    assert (last["exit_code"], last["log_path"], last["image"]) == (0, rec["log_path"], rec["image"])
    assert last["egress"] == rec["egress"] and last["duration_s"] is not None
    for shown in (fila(root, "show", tid).stdout, fila(root, "review", tid, "--no-pager").stdout):
        assert "1 claude: quota" in shown and "2 shell: success" in shown, shown
        assert first["log_path"] in shown and rec["log_path"] in shown
        assert re.search(r"egress \d+ allowed, \d+ denied; anthropic \d+ requests \(200: 1, 429: ", shown)

    # BLOCKED: the job's egress budget (max_requests 1) ends claude's run with the gateway's own
    # 429: a fallback would get no new budget, so the task fails as quota, naming the budget.
    upstreams.set_script([{"protocol": "anthropic", "when": "no_tool_result", "reply": {"tool": WRITE}}])
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "claude", *prompt, *shell_cmd, "--policy", "budget")
    done = _run_once(root, secret)
    rec = record(root, tid)
    assert rec["status"] == "failed", done.stderr[-2000:]
    assert rec["error"]["kind"] == "quota" and "egress budget max_requests" in rec["error"]["message"]
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [("claude", "failed")]
    assert len(upstreams.requests("model.test")) == 1  # the second request never left the gateway

    # BLOCKED: auth never falls back (a fallback would not fix a key).
    upstreams.set_script(
        [{"protocol": "anthropic", "error": {"status": 401, "message": "invalid api key"}}] * 12
    )
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "claude", *prompt, *shell_cmd, "--policy", "chain")
    done = _run_once(root, secret)
    rec = record(root, tid)
    assert rec["status"] == "failed", done.stderr[-2000:]
    assert rec["error"]["kind"] == "auth", rec["error"]
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [("claude", "failed")]
    assert "+from shell" not in _log(root, rec.get("patch_path"))

    # BLOCKED: an engine error never falls back: shell fails, claude (its fallback) never runs.
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "shell", "--command", "exit 3", *prompt, "--fallback", "claude",
                  "--policy", "chain")  # fmt: skip
    done = _run_once(root, secret)
    rec = record(root, tid)
    assert rec["status"] == "failed" and rec["error"]["kind"] == "engine_error", done.stderr[-2000:]
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [("shell", "failed")]
    assert upstreams.requests("model.test") == []


def test_the_chain_is_the_tasks_fallback_else_the_policys_and_an_empty_list_means_none() -> None:
    pol = Policy.model_validate({"max_timeout_ms": 1000, "default_timeout_ms": 1000, "fallback": ["shell"]})
    task = Task(engine="claude", prompt="x", targets=["a"])
    assert [n for _f, n in fallback_chain(task, pol)] == ["claude", "shell"]
    own = task.model_copy(update={"fallback": ["codex", "claude", "codex"]})
    assert fallback_chain(own, pol) == [("engine", "claude"), ("fallback.0", "codex")]
    assert fallback_chain(task.model_copy(update={"fallback": []}), pol) == [("engine", "claude")]


# -- refused at submit, before any container: exit 2 naming the field -------------------------------


def _refusal_policy(root: Path, name: str, **doc: Any) -> None:
    # claude's route, so the case at hand is the one refused (network none refuses claude itself).
    base = {
        "max_timeout_ms": 60_000,
        "default_timeout_ms": 60_000,
        "network": "allowlist",
        "egress": {"routes": {"anthropic": {"credential": KEY_VAR}}},
    }
    write_policy(root, name, {**base, **doc})


@pytest.fixture
def sub_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(KEY_VAR, "sk-test")
    make_root(tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    _refusal_policy(tmp_path, "default")
    _refusal_policy(tmp_path, "narrow", images=["fila/claude:*", "fila/shell:*"])
    _refusal_policy(tmp_path, "typo", fallback=["shel"])
    _refusal_policy(tmp_path, "anthropic-only")
    return tmp_path


CLAUDE = ("submit", "--target", "a.txt", "--engine", "claude", "--prompt", "x", "--command", "true")


@pytest.mark.parametrize(
    ("allowed", "refused", "field"),
    [
        # a fallback naming an unknown engine
        (("--fallback", "shell"), ("--fallback", "shell", "--fallback", "gpt"), "fallback.1"),
        # an unknown engine in the policy's default chain
        (("--fallback", "shell"), ("--policy", "typo"), "policy 'typo' fallback.0"),
        # a fallback whose image the policy does not allow
        (
            ("--policy", "narrow", "--fallback", "shell"),
            ("--policy", "narrow", "--fallback", "codex"),
            "fallback.0",
        ),
        # a fallback whose model route the allowlist policy has no credential for
        (
            ("--policy", "anthropic-only", "--fallback", "shell"),
            ("--policy", "anthropic-only", "--fallback", "codex"),
            "fallback.0",
        ),
    ],
)
def test_a_bad_fallback_is_refused_at_submit_naming_the_field(
    sub_root: Path, allowed: tuple[str, ...], refused: tuple[str, ...], field: str
) -> None:
    ok = fila(sub_root, *CLAUDE, *allowed, env={KEY_VAR: "sk-test"})
    assert ok.exit_code == 0, ok.output
    bad = fila(sub_root, *CLAUDE, *refused, env={KEY_VAR: "sk-test"})
    assert bad.exit_code == 2, bad.output
    assert f"field '{field}'" in bad.output, bad.output
    assert sorted(p.name for p in (sub_root / "fila" / "in").glob("*.json")) == [f"{ok.stdout.strip()}.json"]


def test_an_unknown_engine_is_refused_naming_the_field(sub_root: Path) -> None:
    assert (
        fila(sub_root, "submit", "--target", "a.txt", "--engine", "shell", "--command", "true").exit_code == 0
    )
    bad = fila(sub_root, "submit", "--target", "a.txt", "--engine", "shelll", "--command", "true")
    assert bad.exit_code == 2 and "field 'engine': unknown engine 'shelll'" in bad.output, bad.output
    assert "valid engines:" in bad.output


def test_a_prompt_over_the_policys_cap_is_refused_naming_the_field(sub_root: Path) -> None:
    _refusal_policy(sub_root, "short", max_prompt_bytes=1024)
    args = ("submit", "--target", "a.txt", "--engine", "claude", "--policy", "short", "--prompt")
    ok = fila(sub_root, *args, "é" * 512)  # 1024 bytes in UTF-8: at the cap
    assert ok.exit_code == 0, ok.output
    bad = fila(sub_root, *args, "é" * 512 + "x")
    assert bad.exit_code == 2 and "field 'prompt'" in bad.output and "max_prompt_bytes 1024" in bad.output


@pytest.mark.docker
@pytest.mark.engines
def test_the_tasks_own_chain_runs_in_order_until_an_engine_is_not_out_of_quota(
    fb_root: Path,
    upstreams: Upstreams,
) -> None:
    root = fb_root
    quota = {"error": {"status": 429, "message": RATE, "retry_after": 0}}
    upstreams.set_script(
        [*[{"protocol": "anthropic", **quota}] * 12, *[{"protocol": "responses", **quota}] * 12]
    )
    upstreams.clear_requests()
    tid = _submit(root, "--engine", "claude", "--fallback", "codex", "--fallback", "shell",
                  "--prompt", "Create hello.txt.", "--command", "echo from shell >> a.txt",
                  "--policy", "chain")  # fmt: skip
    done = _run_once(root, f"sk-test-{secrets.token_hex(16)}")
    rec = record(root, tid)
    assert rec["status"] == "needs_review", (rec["error"], done.stderr[-2000:])
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [
        ("claude", "quota"),
        ("codex", "quota"),
        ("shell", "success"),
    ]
    kept = [a["log_path"] for a in rec["attempts"][:2]]
    assert kept == [f"fila/logs/{tid}~1-1-claude.log", f"fila/logs/{tid}~1-2-codex.log"]
    # Both CLIs really met the 429 (the model server logged each one's requests).
    paths = {r["path"].rsplit("/", 1)[-1] for r in upstreams.requests("model.test")}
    assert {"messages", "responses"} <= paths, paths
    assert "+from shell" in (root / rec["patch_path"]).read_text()


# -- falling back promptly: the upstream's quota answer ends the attempt (docs/engines.md) ----------

# Per-minute wording: gemini-cli retries it ten times with its own backoff (about four minutes), qwen
# up to ten times a minute apart; cut short, each falls back within seconds.
PER_MINUTE = {"status": 429, "message": RATE, "retry_after": 0}
CUT_ENGINES = {  # engine: (route, the model server's protocol, model)
    "gemini": ("gemini", "gemini", "gemini-2.5-pro"),
    "qwen": ("openai", "openai", "qwen3-coder-plus"),
}


@pytest.fixture
def cut_root(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    gateway_image: str,
) -> Path:
    _engines_root(tmp_path, docker_client, ("gemini", "qwen", "shell"))
    route = {"upstream": "https://model.test", "credential": KEY_VAR, "ca_file": str(upstreams.ca_file)}
    _policy(tmp_path, upstreams, "models", egress={"routes": {"gemini": route, "openai": route}})
    return tmp_path


@pytest.mark.docker
@pytest.mark.engines
# The watch reads the route's 429 whichever CLI met it (the unit cases below): the default run
# cuts qwen's own retry loop short (its only real 429 there: tests/test_engines.py runs gemini's);
# --all gemini's too.
@pytest.mark.parametrize("engine", matrix_beyond(CUT_ENGINES, "qwen"))
def test_a_quota_answer_with_a_fallback_waiting_cuts_the_attempt_short_within_seconds(
    engine: str,
    cut_root: Path,
    upstreams: Upstreams,
) -> None:
    root = cut_root
    route, protocol, model = CUT_ENGINES[engine]
    upstreams.set_script([{"protocol": protocol, "error": PER_MINUTE}] * 12)
    upstreams.clear_requests()
    tid = _submit(root, "--engine", engine, "--model", model, "--prompt", "Create hello.txt.",
                  "--fallback", "shell", "--command", "echo from shell >> a.txt",
                  "--policy", "models")  # fmt: skip
    done = _run_once(root, f"sk-test-{secrets.token_hex(16)}")
    rec = record(root, tid)
    assert rec["status"] == "needs_review", (rec["error"], done.stderr[-2000:])
    assert [(a["engine"], a["outcome"]) for a in rec["attempts"]] == [(engine, "quota"), ("shell", "success")]
    first = rec["attempts"][0]
    # The gateway saw the upstream's 429 and fila stopped the engine there, not after its retries:
    # under 30 s of engine time (the CLI's own loop takes minutes), and the record says why.
    assert first["duration_s"] is not None and first["duration_s"] < 30, first
    assert first["cut_short"] and f"route {route} answered HTTP 429" in first["cut_short"], first
    assert "fallback to shell" in first["cut_short"]
    assert first["error"]["kind"] == "quota" and "cut short" in first["error"]["message"]
    assert first["egress"]["routes"][route]["statuses"].get("429", 0) >= 1, first["egress"]
    assert first["exit_code"] not in (0, None)
    got = upstreams.requests("model.test")
    assert got and {r["status"] for r in got} == {429} and len(got) < 10, [r["status"] for r in got]
    assert rec["attempts"][1]["cut_short"] is None
    assert "+from shell" in (root / rec["patch_path"]).read_text()
    for shown in (fila(root, "show", tid).stdout, fila(root, "review", tid, "--no-pager").stdout):
        assert f"1 {engine}: quota" in shown and first["cut_short"] in shown, shown


def test_the_quota_watch_reads_the_upstreams_429_on_the_engines_routes_only(tmp_path: Path) -> None:
    from fila.run.quota_watch import QuotaWatch
    from fila.sandbox.base import StopRun

    log = tmp_path / "log" / "egress.jsonl"
    watch = QuotaWatch(log, ["openai"], then="shell")
    assert watch.poll() is None  # no log yet: the gateway has not written it

    def line(**kw: Any) -> str:
        return json.dumps({"door": "route", "route": "openai", "allowed": True, "status": 200} | kw) + "\n"

    log.parent.mkdir()
    with log.open("a") as f:
        f.write(line(status=None, reason="in flight"))
        f.write(line())  # a model call that succeeded
        f.write(line(route="gemini", status=429))  # not this engine's route
        f.write(line(status=429, allowed=False, budget="max_requests"))  # the gateway's own budget
        f.write(line(door="proxy", route=None, status=429, host="example.com"))  # not a model route
        f.write(line(status=429)[:20])  # a line still being written
    assert watch.poll() is None
    watch.check()  # nothing to stop for
    with log.open("a") as f:
        f.write(line(status=429)[20:])
    why = watch.poll()
    assert why == (
        "cut short for the fallback to shell: the model route openai answered HTTP 429 (gateway log)"
    )
    with pytest.raises(StopRun) as e:
        watch.check()
    assert e.value.reason == why


def test_the_quota_watch_never_follows_a_link_in_place_of_the_log(tmp_path: Path) -> None:
    from fila.run.quota_watch import QuotaWatch

    elsewhere = tmp_path / "elsewhere.jsonl"
    quota = {"door": "route", "route": "openai", "allowed": True, "status": 429}
    elsewhere.write_text(json.dumps(quota) + "\n")
    log = tmp_path / "log" / "egress.jsonl"
    log.parent.mkdir()
    log.symlink_to(elsewhere)
    watch = QuotaWatch(log, ["openai"], then="shell")
    assert watch.poll() is None
    # The counterpart: the same line in the log itself stops the run.
    log.unlink()
    log.write_text(elsewhere.read_text())
    assert QuotaWatch(log, ["openai"], then="shell").poll() is not None


def test_a_record_of_an_older_version_still_loads_and_lists_its_attempts() -> None:
    from fila.core.models import Record
    from fila.review.report import attempt_lines

    # Before attempts were numbered 1, 2, ...: both engines of the run had the claim's count, and
    # only the engine that fell back had its own exit code and log.
    older = {
        "id": "t1",
        "status": "needs_review",
        "attempt": 1,
        "attempts": [
            {"number": 1, "engine": "claude", "outcome": "quota", "exit_code": 1,
             "error": {"kind": "quota", "message": "429"}, "log_path": "fila/logs/t1.1-1-claude.log"},
            {"number": 1, "engine": "shell", "outcome": "success"},
        ],
    }  # fmt: skip
    rec = Record.model_validate(older)
    assert [(a.run, a.duration_s, a.cut_short, a.egress) for a in rec.attempts] == [
        (None, None, None, None)
    ] * 2
    lines = attempt_lines(rec, "attempt", 10)
    assert lines == [
        "attempt   1 claude: quota, exit 1",
        "            log fila/logs/t1.1-1-claude.log",
        "          1 shell: success",
    ]

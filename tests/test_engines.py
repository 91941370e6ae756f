"""Engine adapters (claude, codex, opencode, gemini, qwen, aider).

Unit tests read output captured from the REAL CLIs in their real images against the scripted model
server (tests/fixtures/engines/<engine>/*.log, see its README): classification and the report are
proven on what the CLIs really print. A capture holds both streams interleaved and is given to
`classify` as stdout (the worst case: the CLI's text among its JSON); the separation of stdout from
stderr is proven by the cases that put a capture on one stream and another on the other, and on the
real daemon. The end-to-end tests (marked docker and engines) run each real CLI in its image through
fila and the egress gateway.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import docker
import pytest

from fila.core.layout import Root
from fila.core.models import EgressRecord, EgressRequest, ImageRef, Policy, Task
from fila.engines import get_engine
from fila.sandbox.base import RunOutput, RunSpec
from fila.sandbox.docker.backend import DockerBackend
from fila.workspace import overlay as fila_overlay
from fila.workspace.strategy import CopyWorkspace
from tests.support.engines import (
    E2E_ENGINES,
    engine_image,
    model_script,
    run_engine_task,
)
from tests.support.marks import matrix_beyond, quick_for
from tests.support.policy import edit_policy
from tests.upstreams import Upstreams

FIXTURES = Path(__file__).parent / "fixtures" / "engines"


def captured_text(engine: str, case: str) -> str:
    return (FIXTURES / engine / f"{case}.log").read_text()


def captured(engine: str, case: str) -> RunOutput:
    """A capture as the backend's output: its text on stdout, nothing on stderr."""
    return RunOutput(stdout=(FIXTURES / engine / f"{case}.log").read_bytes())


def out(stdout: str = "", stderr: str = "", *, truncated: bool = False) -> RunOutput:
    return RunOutput(stdout=stdout.encode(), stderr=stderr.encode(), stdout_truncated=truncated)


def task(engine: str, model: str | None = None) -> Task:
    return Task(engine=engine, prompt="Create hello.txt", model=model, targets=["a.txt"])


def policy(deny: list[str]) -> Policy:
    return Policy.model_validate({"max_timeout_ms": 60_000, "default_timeout_ms": 60_000, "deny": deny})


# -- classification and report from captured output ----------------------------------------------

CASES = [
    # engine, captured case, exit code the CLI gave, kind, words of the CLI's own message
    ("claude", "success", 0, "success", "Wrote hello.txt."),
    ("claude", "quota", 1, "quota", "rate limit"),
    ("claude", "auth", 1, "auth", "Invalid API key"),
    ("codex", "success", 0, "success", "Wrote hello.txt."),
    ("codex", "quota", 1, "quota", "429 Too Many Requests"),
    ("codex", "auth", 1, "auth", "401 Unauthorized"),
    ("opencode", "success", 0, "success", "Wrote hello.txt."),
    ("opencode", "quota", 1, "quota", "rate limit"),
    ("opencode", "auth", 1, "auth", "Incorrect API key"),
    ("opencode", "engine_error", 1, "engine_error", "cannot be parsed as a URL"),
    ("gemini", "success", 0, "success", "Wrote hello.txt."),
    ("gemini", "quota", 1, "quota", "rate limit"),
    ("gemini", "auth", 1, "auth", "API key not valid"),
    ("qwen", "success", 0, "success", "Wrote hello.txt."),
    ("qwen", "auth", 1, "auth", "401 Incorrect API key"),
    # qwen retried the 429s until the script ran out; its last word was the 500 (the gateway's
    # 429s make it quota: see test_the_gateways_429_beats_the_engines_word)
    ("qwen", "quota", 1, "engine_error", "500"),
    ("aider", "success", 0, "success", ""),
    # aider retries about a minute, then exits 0: the text decides
    ("aider", "quota", 0, "quota", "RateLimitError"),
    ("aider", "auth", 0, "auth", "AuthenticationError"),
]


@pytest.mark.parametrize(("engine", "case", "code", "kind", "words"), CASES)
def test_a_run_is_classified_from_the_clis_structured_output(
    engine: str, case: str, code: int, kind: str, words: str
) -> None:
    o = get_engine(engine).classify(code, captured(engine, case))
    assert o.kind == kind
    assert words in o.message


@pytest.mark.parametrize(
    ("engine", "case"), [("claude", "quota"), ("claude", "auth"), ("opencode", "auth"), ("codex", "quota")]
)
def test_exit_0_with_an_error_in_the_json_is_an_error(engine: str, case: str) -> None:
    # The same captured error output, as if the CLI had exited 0: still not a success.
    assert get_engine(engine).classify(0, captured(engine, case)).kind in ("quota", "auth")
    assert get_engine(engine).classify(0, captured(engine, "success")).kind == "success"


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        # the scripted server's usage: 120+200 in, 30+12 out (claude); 150+260 in, 40+9 out (others)
        (
            "claude",
            {
                "model": "claude-sonnet-4-5",
                "turns": 2,
                "input_tokens": 320,
                "output_tokens": 42,
                "cost_usd": 0.00159,
            },
        ),
        ("codex", {"turns": 1, "input_tokens": 410, "output_tokens": 49, "cost_usd": None}),
        ("opencode", {"turns": 2, "input_tokens": 410, "output_tokens": 49, "cost_usd": 0}),
        ("gemini", {"model": "gemini-2.5-pro", "turns": 2, "input_tokens": 410, "output_tokens": 49}),
        ("qwen", {"model": "qwen3-coder-plus", "turns": 2, "input_tokens": 410, "output_tokens": 49}),
        # aider counts tokens itself (its tokenizer over what it sent), not the server's usage
        ("aider", {"model": "openai/m1", "turns": 1, "input_tokens": 656, "output_tokens": 12}),
    ],
)
def test_the_report_holds_what_the_cli_says_about_model_turns_usage_and_cost(
    engine: str, expected: dict[str, object]
) -> None:
    report = get_engine(engine).classify(0, captured(engine, "success")).report
    assert report is not None
    assert {k: report[k] for k in expected} == expected
    assert report.get("session_id") or engine == "aider"  # aider has no session id


BIG = "9" * 40
DEEP = "[" * 100_000 + "]" * 100_000
# What a hostile engine prints where its CLI prints its result: each line breaks that adapter's
# reading (a field of another type, a number past any limit, nesting past the recursion limit) or
# holds what no reader of a record accepts (a 40-digit count, a NUL, a lone surrogate).
HOSTILE = [
    ("claude", '{"type":"result","result":"ok","modelUsage":5}'),
    ("claude", '{"type":"result","result":"ok","session_id":' + DEEP + "}"),
    ("codex", '{"type":"turn.completed","usage":"x"}'),
    ("opencode", '{"type":"step_finish","sessionID":"s","part":{"tokens":{"input":"x"}}}'),
    ("gemini", '{"response":"ok","stats":{"models":{"m":{"api":{"totalRequests":1e400}}}}}'),
    ("qwen", '{"type":"result","result":"ok","permission_denials":5}'),
    ("aider", "Model: m\nTokens: 1.2.3 sent, 5 received.\nApplied edit to a.txt\n"),
    # aider exits 0 after its API failed: read, this is an error; unread, it must not be a success
    ("aider", "Tokens: , sent, 1 received.\nlitellm.APIError: upstream died\n"),
    # JSON past a reader's limit is not skipped as if it were text: it may have been the result
    ("claude", '{"type":"result","is_error":true,"result":"API Error","num_turns":' + "9" * 5000 + "}"),
    ("gemini", '{"response":"ok"}\n{"error":{"message":"boom"},"n":' + "9" * 5000 + "}"),
    ("gemini", '{"response":"ok"}\n{"error":' + "[" * 5000 + "]" * 5000 + "}"),
]


@pytest.mark.parametrize(("engine", "stdout"), HOSTILE)
def test_structured_output_that_breaks_the_adapter_leaves_the_exit_code_to_decide(
    engine: str, stdout: str
) -> None:
    e = get_engine(engine)
    ok = e.classify_run(0, captured(engine, "success"))  # the allowed counterpart: read as printed
    assert ok.kind == "success" and ok.report == e.classify(0, captured(engine, "success")).report
    assert ok.report and ok.report.get("turns")
    for code in (0, 3):  # never a success: the result fila could not read may have been an error
        o = e.classify_run(code, out(stdout))
        assert (o.kind, o.report) == ("engine_error", None)
        assert "its structured output could not be read (" in o.message, o.message
        assert code == 0 or f"exited with code {code}" in o.message


def test_a_report_past_the_records_limits_keeps_what_reads_and_drops_the_rest() -> None:
    from fila.core import untrusted
    from fila.core.errors import InvalidInput
    from fila.core.models import Record

    line = (
        '{"type":"result","is_error":true,"result":"bad\\u0000news \\ud800 here","num_turns":[1],'
        f'"usage":{{"input_tokens":{BIG},"output_tokens":1e400}},"total_cost_usd":0.5,'
        '"session_id":{"a":1},"modelUsage":{"m1":{}}}'
    )
    o = get_engine("claude").classify_run(1, out(line))
    assert o.kind == "engine_error" and o.message == "badnews ? here"
    assert o.report == {"model": "m1", "turns": None, "input_tokens": None, "output_tokens": None,
                        "cost_usd": 0.5, "session_id": None, "permission_denials": 0}  # fmt: skip
    rec = Record.model_validate({"id": "t", "status": "failed", "engine_report": o.report,
                                 "error": {"kind": "engine_error", "message": o.message}})  # fmt: skip
    text = rec.model_dump_json().encode()
    assert (
        Record.model_validate(untrusted.parse_json(text, kind="record", error=InvalidInput, path=None)) == rec
    )
    # What EngineReport makes of strings is bounded too: a 31-digit count, "NaN", "Infinity".
    coerced = (
        '{"type":"result","result":"ok","num_turns":"%s","total_cost_usd":"NaN",'
        '"usage":{"input_tokens":"12","output_tokens":"Infinity"}}' % ("9" * 31)
    )
    o = get_engine("claude").classify_run(0, out(coerced))
    assert o.kind == "success"
    assert o.report == {"model": None, "turns": None, "input_tokens": 12, "output_tokens": None,
                        "cost_usd": None, "session_id": None, "permission_denials": 0}  # fmt: skip
    # A float that PostgreSQL's jsonb prints with 31 digits (1e30) is past the limit too; 1e29 reads.
    for cost, kept in (("1e29", 1e29), ("1e30", None)):
        priced = '{"type":"result","result":"ok","total_cost_usd":' + cost + "}"
        assert (get_engine("claude").classify_run(0, out(priced)).report or {})["cost_usd"] == kept
    # The unbounded report, as the adapter made it, is what a reader refuses.
    raw = get_engine("claude").classify(1, out(line)).report
    assert raw is not None and raw["input_tokens"] == int(BIG)
    with pytest.raises(InvalidInput, match="digit limit"):
        untrusted.parse_json(json.dumps(raw).encode(), kind="record", error=InvalidInput, path=None)


def test_a_quota_line_split_by_a_unicode_line_separator_still_names_its_words() -> None:
    o = get_engine("claude").classify_run(1, out("boom: rate\u2028limit reached\n"))
    assert o.kind == "quota" and "rate\u2028limit reached" in o.message


def test_aiders_model_is_read_from_its_main_model_line_when_a_weak_model_is_beside_it() -> None:
    # aider 0.86 says `Main model: M` (then `Weak model: W`) for a model with a weak model, and
    # `Model: M` for one without: both name the model the run used, never the weak one.
    report = get_engine("aider").classify(0, captured("aider", "main_model")).report
    assert report is not None
    assert (report["model"], report["turns"], report["input_tokens"]) == ("openai/gpt-4o", 1, 829)
    assert get_engine("aider").classify(0, captured("aider", "success")).report["model"] == "openai/m1"  # type: ignore[index]


def test_text_before_the_result_on_stdout_is_skipped() -> None:
    text = "garbage {not json\n" + captured_text("claude", "success")
    assert get_engine("claude").classify(0, out(text[5:])).kind == "success"


def test_without_structured_output_the_text_of_either_stream_decides() -> None:
    claude = get_engine("claude")
    assert claude.classify(1, out("Error: 429 rate limit reached\n")).kind == "quota"
    assert claude.classify(1, out(stderr="Error: 429 rate limit reached\n")).kind == "quota"
    assert claude.classify(1, out(stderr="Error: invalid api key\n")).kind == "auth"
    assert claude.classify(1, out("segfault\n", "core dumped\n")).kind == "engine_error"


# -- stdout apart from stderr: the result is stdout's, and all of it -----------------------------

STRUCTURED = ["claude", "codex", "opencode", "gemini", "qwen"]


@pytest.mark.parametrize("engine", STRUCTURED)
def test_an_error_result_on_stderr_is_not_taken_as_the_result(engine: str) -> None:
    # The CLI's real error output, printed on stderr beside a real success on stdout: stdout's result
    # decides. The counterpart (the same two captures, streams swapped) is the error.
    e = get_engine(engine)
    both = RunOutput(stdout=captured(engine, "success").stdout, stderr=captured(engine, "auth").stdout)
    swapped = RunOutput(stdout=captured(engine, "auth").stdout, stderr=captured(engine, "success").stdout)
    assert e.classify_run(0, both).kind == "success"
    assert e.classify_run(0, swapped).kind == "auth"
    assert e.classify_run(1, swapped).kind == "auth"


def test_a_json_line_on_stderr_that_looks_like_a_result_is_not_the_result() -> None:
    forged = json.dumps({"type": "result", "is_error": True, "api_error_status": 429, "result": "rate limit"})
    claude = get_engine("claude")
    assert claude.classify_run(0, out(captured_text("claude", "success"), forged + "\n")).kind == "success"
    # On stdout, after the real result, the same line is the CLI's last word: quota.
    assert claude.classify_run(0, out(captured_text("claude", "success") + forged + "\n")).kind == "quota"


def _big_claude_result(size: int, *, error: bool = False) -> str:
    ok = json.loads(next(ln for ln in captured_text("claude", "success").splitlines() if '"result"' in ln))
    return json.dumps({**ok, "result": "Wrote hello.txt. " + "x" * size, "is_error": error}) + "\n"


def test_a_final_result_larger_than_256_kib_is_still_found() -> None:
    claude = get_engine("claude")
    big = _big_claude_result(600 << 10)
    assert len(big) > 2 * (256 << 10)
    o = claude.classify_run(0, out(big, "warning: something on stderr\n"))
    assert o.kind == "success" and o.message.startswith("Wrote hello.txt.") and o.report is not None
    assert o.report["input_tokens"] == 320
    # The same large result as an error is read as one too.
    assert claude.classify_run(1, out(_big_claude_result(600 << 10, error=True))).kind == "engine_error"
    # Its last 256 KiB alone (what classification read before) hold no result: the text decided.
    assert claude.classify_run(0, out(big[-(256 << 10) :])).report is None


def test_gemini_finds_its_indented_result_larger_than_256_kib() -> None:
    gemini = get_engine("gemini")
    text = captured_text("gemini", "success")
    start = text.index("\n{") + 1
    doc = json.loads(text[start:])
    big = json.dumps({**doc, "response": "Wrote hello.txt. " + "y" * (400 << 10)}, indent=2)
    o = gemini.classify_run(0, out(big + "\n", text[:start]))
    assert o.kind == "success" and o.message.startswith("Wrote hello.txt.")


def test_gemini_reads_its_error_object_on_stderr_when_stdout_has_no_result() -> None:
    # gemini's error handler prints its JSON error to stderr (seen on a stream cut mid-way: stdout
    # empty, the stack trace's "bytesRead: 401" and then {"error": {"message": "terminated"}} on
    # stderr). The error object decides, not the words around it.
    gemini = get_engine("gemini")
    trace = "TypeError: terminated\n    socket: {\n      bytesRead: 401\n    }\n"
    error = json.dumps({"session_id": "s1", "error": {"type": "Error", "message": "terminated", "code": 1}})
    o = gemini.classify_run(1, out("", trace + error + "\n"))
    assert (o.kind, o.message) == ("engine_error", "terminated")
    assert gemini.classify_run(1, out("", trace)).kind == "auth"  # without it, the words decided
    # The real auth capture, all on stderr: its error object (code 401) decides.
    auth = gemini.classify_run(1, RunOutput(stderr=captured(engine="gemini", case="auth").stdout))
    assert auth.kind == "auth" and "API key not valid" in auth.message
    # A result on stderr is never taken: only an error object is read there.
    forged = json.dumps({"session_id": "s1", "response": "all done"})
    assert gemini.classify_run(1, out("", forged + "\n")).kind == "engine_error"


def test_gemini_survives_a_stdout_of_objects_that_never_close() -> None:
    # stdout is read whole: a hostile engine printing thousands of nested, unclosed objects after
    # its result must not crash or stall classification (it only loses its own result).
    gemini = get_engine("gemini")
    hostile = captured_text("gemini", "success") + '{"a":\n' * 50_000
    assert gemini.classify_run(0, out(hostile)).kind == "success"
    assert gemini.classify_run(1, out(hostile)).kind == "engine_error"
    assert gemini.classify_run(1, out(hostile, "Error: invalid api key\n")).kind == "auth"


@pytest.mark.parametrize("engine", [*STRUCTURED, "aider"])
def test_a_truncated_stdout_is_read_as_far_as_it_was_kept(engine: str) -> None:
    # docs/engines.md: what was kept before the cut decides as usual; with the result past the
    # cut, the text rules and the exit code decide.
    e = get_engine(engine)
    whole = captured(engine, "success").stdout
    kept = RunOutput(stdout=whole, stdout_truncated=True)
    assert e.classify_run(0, kept).kind == "success"
    auth = RunOutput(stdout=captured(engine, "auth").stdout, stdout_truncated=True)
    assert e.classify_run(0, auth).kind == "auth"
    head = whole[: len(whole) // 2]
    # aider's own rule: no answer seen (its `Tokens:` line was past the cut) is an error.
    expected = "engine_error" if engine == "aider" else "success"
    assert e.classify_run(0, RunOutput(stdout=head, stdout_truncated=True)).kind == expected
    assert e.classify_run(7, RunOutput(stdout=head, stdout_truncated=True)).kind == "engine_error"


def test_a_result_past_the_cut_leaves_the_text_and_the_exit_code_to_decide() -> None:
    claude = get_engine("claude")
    big = _big_claude_result(600 << 10, error=True).encode()
    assert claude.classify_run(1, RunOutput(stdout=big)).report is not None  # read whole: its result
    cut = RunOutput(stdout=big[: 256 << 10], stdout_truncated=True)
    o = claude.classify_run(1, cut)
    assert (o.kind, o.report, o.message) == ("engine_error", None, "claude exited with code 1")
    quota = RunOutput(stdout=cut.stdout, stderr=b"Error: 429 rate limit reached\n", stdout_truncated=True)
    assert claude.classify_run(1, quota).kind == "quota"


def test_the_shell_engines_exit_code_decides_also_when_its_output_was_cut() -> None:
    shell = get_engine("shell")
    assert shell.classify_run(0, out("x" * 1000, truncated=True)).kind == "success"
    assert shell.classify_run(3, out("x" * 1000, truncated=True)).kind == "engine_error"
    assert shell.classify_run(0, out("429 rate limit\n", "invalid api key\n")).kind == "success"


def test_the_gateways_429_beats_the_engines_word_qwen() -> None:
    qwen = get_engine("qwen")
    seen = EgressRecord(requests=[EgressRequest(door="route", route="openai", status=429, allowed=True)])
    assert qwen.classify_run(1, captured("qwen", "quota"), None).kind == "engine_error"
    assert qwen.classify_run(1, captured("qwen", "quota"), seen).kind == "quota"


def test_the_gateways_429_beats_the_engines_word() -> None:
    opencode = get_engine("opencode")
    text = captured("opencode", "engine_error")
    seen = EgressRecord(requests=[EgressRequest(door="route", route="openai", status=429, allowed=True)])
    assert opencode.classify_run(1, text, None).kind == "engine_error"  # the allowed counterpart
    assert opencode.classify_run(1, text, seen).kind == "quota"
    # A success stays a success even when one request on the way was rate limited and retried.
    assert opencode.classify_run(0, captured("opencode", "success"), seen).kind == "success"


# -- invocations: the deny rules each CLI understands --------------------------------------------


def test_claude_gets_the_policys_deny_rules_as_its_own_permissions() -> None:
    inv = get_engine("claude").invocation_for(
        task("claude", "claude-sonnet-4-5"), policy(["/hello.txt", "*.pem"])
    )
    settings = json.loads(inv.argv[inv.argv.index("--settings") + 1])
    assert settings["permissions"]["deny"] == [
        "Read(./hello.txt)",
        "Edit(./hello.txt)",
        "Read(*.pem)",
        "Edit(*.pem)",
    ]
    assert settings["permissions"]["allow"] == ["Bash"]  # the project's tests, run in the sandbox
    assert inv.argv[inv.argv.index("--model") + 1] == "claude-sonnet-4-5"
    assert inv.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert inv.env["CLAUDE_CONFIG_DIR"].startswith(inv.env["HOME"])


def test_claude_captured_a_write_its_deny_rule_refused() -> None:
    # Captured with the invocation above: the CLI refused the scripted Write and said so.
    o = get_engine("claude").classify(0, captured("claude", "denied"))
    assert o.kind == "success" and o.report is not None and o.report["permission_denials"] == 1


def test_opencode_gets_the_policys_deny_rules_as_permission_globs() -> None:
    inv = get_engine("opencode").invocation_for(
        task("opencode", "m1"), policy(["hello.txt", "secrets/", "!x"])
    )
    cfg = json.loads(inv.env["OPENCODE_CONFIG_CONTENT"])
    edit = cfg["permission"]["edit"]
    assert edit["*"] == "allow"
    for glob in ("hello.txt", "**/hello.txt", "/job/work/hello.txt", "secrets/**", "**/secrets/**"):
        assert edit[glob] == "deny", glob
    assert cfg["permission"]["read"] == edit
    assert cfg["provider"]["fila"]["options"]["apiKey"] == "{env:OPENAI_API_KEY}"
    assert cfg["model"] == "fila/m1"


def test_opencode_captured_a_write_its_deny_rule_refused() -> None:
    text = captured("opencode", "denied")
    assert "prevents you from using this specific tool call" in text.out()
    assert get_engine("opencode").classify(0, text).kind == "success"


def test_gemini_gets_the_policys_deny_rules_as_its_own_policy_rules() -> None:
    inv = get_engine("gemini").invocation_for(task("gemini"), policy(["hello.txt", "/x/*.pem"]))
    rules = inv.env["FILA_GEMINI_POLICY"]
    assert inv.argv[inv.argv.index("--policy") + 1].endswith("fila-deny.toml")
    assert rules.count("[[rule]]") == 8 and 'decision = "deny"' in rules
    assert '[^\\"]*/hello\\\\.txt' in rules and "/job/work/x/" in rules
    assert "--policy" not in get_engine("gemini").invocation_for(task("gemini"), policy([])).argv


def test_gemini_captured_a_write_its_policy_rule_refused() -> None:
    text = captured("gemini", "denied")
    assert "Tool execution denied by policy" in text.out()
    assert get_engine("gemini").classify(0, text).kind == "success"


def test_qwen_gets_the_policys_deny_rules_as_its_own_permissions() -> None:
    inv = get_engine("qwen").invocation_for(task("qwen"), policy(["hello.txt"]))
    settings = json.loads(inv.env["FILA_QWEN_SETTINGS"])
    assert settings["permissions"]["deny"] == ["Read(hello.txt)", "Edit(hello.txt)"]
    o = get_engine("qwen").classify(0, captured("qwen", "denied"))  # captured with those rules
    assert o.kind == "success" and o.report is not None and o.report["permission_denials"] == 1


def test_codex_is_pointed_at_the_gateway_route_with_its_own_provider() -> None:
    inv = get_engine("codex").invocation(task("codex"))
    configs = [inv.argv[i + 1] for i, a in enumerate(inv.argv) if a == "--config"]
    assert 'model_provider="fila"' in configs
    assert 'model_providers.fila.env_key="OPENAI_API_KEY"' in configs
    assert "analytics.enabled=false" in configs
    assert "$OPENAI_BASE_URL" in inv.argv[2]  # filled in the container, where the gateway is known
    assert inv.argv[inv.argv.index("--model") + 1] == "gpt-5.5"


@pytest.mark.parametrize("engine", ["claude", "codex", "opencode", "gemini", "qwen", "aider"])
def test_a_task_without_a_prompt_is_refused_naming_the_field(engine: str) -> None:
    from fila.core.errors import InvalidTaskFile

    get_engine(engine).invocation(Task(engine=engine, prompt="x", targets=["a"]))  # the allowed one
    with pytest.raises(InvalidTaskFile) as e:
        get_engine(engine).invocation(Task(engine=engine, prompt="", targets=["a"]))
    assert e.value.field == "prompt"


# -- end to end: the real CLI in its image, through fila and the egress gateway -----------------


@pytest.mark.docker
@pytest.mark.engines
@pytest.mark.parametrize("engine", quick_for(E2E_ENGINES, "claude"))
def test_the_real_cli_edits_through_the_gateway_with_a_key_it_never_holds(
    engine: str,
    engine_root: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
) -> None:
    spec = E2E_ENGINES[engine]
    engine_image(docker_client, engine)
    secret = f"sk-test-{secrets.token_hex(16)}"
    script = model_script(spec)
    upstreams.set_script(script)
    upstreams.clear_requests()
    rec = run_engine_task(engine_root, engine, secret=secret)
    assert rec["status"] == "needs_review", (rec["error"], rec["_log"][-2000:], rec["_stderr"][-2000:])
    # The CLI's edit is in the diff.
    patch = (engine_root / rec["patch_path"]).read_text()
    assert "+++ b/hello.txt" in patch and "+hello from the model" in patch, patch
    # The model server saw the CLI's real requests (one tool call, then the final answer), each
    # with the real key the gateway added...
    got = upstreams.requests("model.test")
    steps = [(r["path"], r["status"], r["step"]) for r in got]
    assert [r["step"] for r in got] == list(range(len(script))), steps
    assert all(r["headers"].get(spec.key_header) == spec.key_format.format(key=secret) for r in got)
    # ...which the engine never held: not in its log, its files, the record.
    # The job directory, and on the overlay strategy the upper layer where work/'s files are.
    ov = fila_overlay.job_overlay(Root.at(engine_root), rec["id"])
    job_files = "".join(
        p.read_text(errors="replace")
        for top in (engine_root / "sandbox" / "jobs" / rec["id"], *((ov.upper,) if ov else ()))
        for p in top.rglob("*")
        if p.is_file()
    )
    assert "hello from the model" in job_files  # the engine's own edit was among what was scanned
    record_text = (engine_root / "fila" / "out" / f"{rec['id']}.json").read_text()
    assert [
        where
        for where, text in {"log": rec["_log"], "job": job_files, "record": record_text}.items()
        if secret in text
    ] == []
    # Nothing but the model calls left the engine: no fetch of its own housekeeping was denied.
    denied = [(r["host"], r["reason"]) for r in rec["egress"]["requests"] if not r["allowed"]]
    assert denied == [], denied
    # The gateway measured the script's usage; the CLI reported the same (where it reports usage).
    route = rec["egress"]["routes"][spec.route]
    inp = sum(st["usage"]["input_tokens"] for st in script)
    out = sum(st["usage"]["output_tokens"] for st in script)
    assert (route["requests"], route["input_tokens"], route["output_tokens"]) == (len(script), inp, out)
    report = rec["engine_report"]
    assert report is not None, "the record has no engine_report"
    if engine == "aider":  # aider counts tokens with its own tokenizer; the gateway's meter is above
        assert report["input_tokens"] > 0 and report["output_tokens"] > 0, report
    else:
        assert (report["input_tokens"], report["output_tokens"]) == (inp, out)


@pytest.mark.docker
@pytest.mark.engines
def test_the_policys_deny_rules_reach_the_real_cli_in_a_fila_run(
    engine_root: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
) -> None:
    # The counterpart is the end-to-end test above: the same script writes hello.txt. Here the
    # policy denies hello.txt, and claude's own permission rule (written by the adapter from the
    # policy) refuses the write inside the CLI: the model asked, the tool answered with a denial.
    engine_image(docker_client, "claude")
    edit_policy(engine_root, "claude", deny=["hello.txt"])
    script = model_script(E2E_ENGINES["claude"])
    upstreams.set_script(script)
    upstreams.clear_requests()
    rec = run_engine_task(engine_root, "claude")
    assert rec["status"] == "needs_review", (rec["error"], rec["_log"][-2000:], rec["_stderr"][-2000:])
    assert [r["step"] for r in upstreams.requests("model.test")] == [0, 1]  # it tried, was told no
    patch = (engine_root / rec["patch_path"]).read_text() if rec.get("patch_path") else ""
    assert "hello.txt" not in patch, patch
    # Not only left out of the diff (a denied path never is in it): the CLI itself refused it.
    assert '"permission_denials":[{"tool_name":"Write"' in rec["_log"], rec["_log"][-2000:]


@pytest.mark.docker
@pytest.mark.engines
@pytest.mark.parametrize(
    ("engine", "status", "kind"),
    # Every CLI's classification is proven on its captured output above; the real runs prove the
    # captured output is still what the CLI says. The default run keeps claude's 401 and 429 and
    # gemini's 429 (its wording differs, and a per-minute 429 it would retry for minutes); the
    # rest are the matrix (`scripts/test --all`): qwen's, aider's and opencode's own 429 retries
    # last 40-140 s, and tests/test_fallback.py cuts qwen's short in every run.
    matrix_beyond([(e, 401, "auth") for e in E2E_ENGINES], ("claude", 401, "auth"))
    + matrix_beyond(
        [(e, 429, "quota") for e in E2E_ENGINES], ("claude", 429, "quota"), ("gemini", 429, "quota")
    ),
)
def test_a_429_is_quota_and_a_401_is_auth_with_the_clis_own_message(
    engine: str,
    status: int,
    kind: str,
    engine_root: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
) -> None:
    spec = E2E_ENGINES[engine]
    engine_image(docker_client, engine)
    message = {
        429: "Number of request tokens has exceeded your per-minute rate limit",
        401: "invalid api key",
    }[status]
    if engine == "gemini" and status == 429:
        # Gemini's wording for a quota that is used up ("limit: 0"): gemini-cli gives up at once.
        # A per-minute 429 it retries ten times with its own 5-30 s backoff (about four minutes),
        # past the task timeout on a loaded machine.
        message = f"{message}: Quota exceeded for metric generate_content_requests, limit: 0"
    step = {
        "protocol": spec.protocol,
        "error": {"status": status, "message": message, "retry_after": 0},
    }
    upstreams.set_script([step] * 12)
    upstreams.clear_requests()
    rec = run_engine_task(engine_root, engine)
    assert rec["status"] == "failed", rec["_log"][-2000:]
    assert rec["error"]["kind"] == kind, (rec["error"], rec["_log"][-2000:])
    assert upstreams.requests("model.test"), "the CLI never reached the model server"
    # The CLI's first request met the scripted error (qwen and aider retry past the script's end,
    # where the server answers 500: the gateway's log still names the quota).
    assert upstreams.requests("model.test")[0]["status"] == status
    # No fallback waits: the CLI's own retries stand, and fila never cuts the attempt short.
    assert [a["cut_short"] for a in rec["attempts"]] == [None], rec["attempts"]


@pytest.mark.docker
@pytest.mark.engines
def test_a_flag_the_cli_no_longer_lists_fails_the_smoke_test(
    docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.core.errors import ImageMissing
    from fila.engines.base import Smoke
    from fila.engines.claude import ClaudeEngine
    from fila.sandbox.images import ensure_image, smoke_test

    backend = DockerBackend(docker_client)
    ref = ensure_image("claude", backend, progress=lambda _l: None)
    smoke_test(backend, "claude", ref, progress=lambda _l: None)  # the real flags: passes
    assert docker_client.images.get("fila/claude:2.1.332").id == ref.id  # tagged with its version
    renamed = (*ClaudeEngine.smoke, Smoke(("claude", "--help"), ("--output-format", "--no-such-flag")))
    monkeypatch.setattr(ClaudeEngine, "smoke", renamed)
    with pytest.raises(ImageMissing) as e:
        smoke_test(backend, "claude", ref, progress=lambda _l: None)
    assert "lists no --no-such-flag" in str(e.value) and "src/fila/engines/claude.py" in str(e.value.hint)


# -- the backend keeps stdout apart from stderr, on the real daemon -----------------------------

CLAUDE_OK = json.dumps({"type": "result", "is_error": False, "result": "done on stdout", "num_turns": 1})
CLAUDE_FORGED = json.dumps({"type": "result", "is_error": True, "api_error_status": 401, "result": "forged"})


def _shell_spec(tmp_path: Path, script: str, **policy_kw: Any) -> RunSpec:
    job_id = f"s2c-{secrets.token_hex(6)}"
    job_dir = tmp_path / "jobs" / job_id
    (job_dir / "input").mkdir(parents=True)
    (job_dir / "work").mkdir()
    (job_dir / "TASK.md").write_text("streams\n")
    doc = {"max_timeout_ms": 60_000, "default_timeout_ms": 20_000, "grace_ms": 1000} | policy_kw
    return RunSpec(
        job_id=job_id,
        workspace=CopyWorkspace(job_dir),
        image="fila/shell:latest",
        argv=["/bin/sh", "-c", script],
        env={"PATH": "/usr/bin:/bin"},
        policy=Policy.model_validate(doc),
        limits=None,
        timeout_ms=20_000,
        log_path=tmp_path / "logs" / f"{job_id}.log",
        labels={"fila.root": str(tmp_path)},
        redact=["sk-s2c-SECRET-0123456789"],
    )


@pytest.mark.docker
def test_the_log_has_both_streams_and_classification_sees_stdout_only(
    tmp_path: Path, docker_client: docker.DockerClient, shell_image: ImageRef
) -> None:
    # The engine prints a success result on stdout and a forged error result on stderr, and a
    # secret split across two frames of stdout with a stderr frame between them (the daemon cuts a
    # line at 16 KiB: the secret straddles that cut, and stderr speaks before the line ends).
    script = (
        "echo 'starting' >&2; "
        f"printf '%s\\n' '{CLAUDE_FORGED}' >&2; "
        "head -c 16378 /dev/zero | tr '\\0' x; printf 'key sk-s2c-SEC'; sleep 0.3; "
        "echo 'between' >&2; sleep 0.3; printf 'RET-0123456789 ok\\n'; "
        f"printf '%s\\n' '{CLAUDE_OK}'"
    )
    spec = _shell_spec(tmp_path, script)
    result = DockerBackend(docker_client).run(spec)
    log = spec.log_path.read_text()
    # The human-readable log has both streams, in the order they came, redacted.
    for line in ("starting", "forged", "between", "*** ok", "done on stdout"):
        assert line in log, log[-500:]
    assert log.index("forged") < log.index("between") < log.index("*** ok") < log.index("done on stdout")
    assert "sk-s" not in log and "RET-0123" not in log, log[16300:16500]
    assert result.log_bytes == len(log.encode())
    # Classification's stdout holds only stdout, redacted; stderr only stderr.
    assert result.output.stdout == b"x" * 16378 + f"key *** ok\n{CLAUDE_OK}\n".encode()
    assert b"forged" in result.output.stderr and b"between" in result.output.stderr
    assert b"done on stdout" not in result.output.stderr
    o = get_engine("claude").classify_run(result.exit_code, result.output)
    assert (o.kind, o.message) == ("success", "done on stdout")


@pytest.mark.docker
def test_a_stdout_past_the_log_cap_is_cut_noted_and_classified_from_what_was_kept(
    tmp_path: Path, docker_client: docker.DockerClient, shell_image: ImageRef
) -> None:
    backend, claude, cap = DockerBackend(docker_client), get_engine("claude"), 64 << 10

    def run(size: int, code: int) -> tuple[RunSpec, Any]:
        script = f"head -c {size} /dev/zero | tr '\\0' x; echo; printf '%s\\n' '{CLAUDE_OK}'; exit {code}"
        spec = _shell_spec(tmp_path, script, max_log_bytes=cap)
        return spec, backend.run(spec)

    # The allowed counterpart: the result after output under the cap is read, with its message.
    _, r = run(1000, 0)
    assert not r.output.stdout_truncated
    assert claude.classify_run(r.exit_code, r.output).message == "done on stdout"
    # Past the cap: the log and stdout stop at the cap, the log says so, the result was not seen.
    spec, r = run(200_000, 0)
    assert r.log_truncated and r.output.stdout_truncated and len(r.output.stdout) <= cap
    assert f"[fila: log truncated at {cap} bytes]" in spec.log_path.read_text()
    o = claude.classify_run(r.exit_code, r.output)
    assert (o.kind, o.message) == ("success", "")  # the exit code's word: the text holds no error
    _, r = run(200_000, 3)
    assert claude.classify_run(r.exit_code, r.output).kind == "engine_error"


@pytest.mark.docker
def test_the_tail_read_after_the_stream_ends_duplicates_nothing_on_the_real_daemon(
    tmp_path: Path, docker_client: docker.DockerClient, shell_image: ImageRef
) -> None:
    # The pump reads the log's last entries again once the followed stream ends (see the next
    # test); on the real daemon that must add nothing already seen, run after run.
    backend = DockerBackend(docker_client)
    for _ in range(5):
        spec = _shell_spec(tmp_path, "echo warn >&2; echo same; echo same; printf '{\\n  \"a\": 1\\n}'")
        r = backend.run(spec)
        assert r.output.stdout == b'same\nsame\n{\n  "a": 1\n}' and r.output.stderr == b"warn\n"
        lines = sorted(spec.log_path.read_bytes().splitlines())
        assert lines == sorted([b"same", b"same", b"{", b'  "a": 1', b"}", b"warn"])


Frames = list[tuple[int, bytes]]


def _pump(tmp_path: Path, followed: Frames, tail: Frames) -> tuple[RunOutput, bytes]:
    from fila.sandbox.docker.logs import LogPump

    log = tmp_path / f"{secrets.token_hex(4)}.log"
    pump = LogPump(lambda: iter(followed), log, 1 << 20, ["sk-pump-secret"], open_tail=lambda: iter(tail))
    pump.run()
    assert pump.error is None
    return pump.output(), log.read_bytes()


def test_what_the_followed_stream_missed_at_its_end_is_added_from_the_logs_tail(tmp_path: Path) -> None:
    # Docker 20.10 was seen to end a follow request before a container's last output without a
    # newline reached it (gemini's closing "}": its result did not parse, the run had no report).
    lines: Frames = [(1, b"{\n"), (2, b"warn\n"), (1, b'  "a": 1\n'), (1, b"}")]
    o, log = _pump(tmp_path, lines[:-1], lines[-3:])
    assert o.stdout == b'{\n  "a": 1\n}' and o.stderr == b"warn\n" and log.endswith(b"}")
    # Nothing missed: nothing added (the allowed counterpart), also with repeated lines.
    o, log = _pump(tmp_path, lines, lines[-3:])
    assert o.stdout == b'{\n  "a": 1\n}' and log == b'{\nwarn\n  "a": 1\n}'
    same: Frames = [(1, b"same\n")] * 4
    assert _pump(tmp_path, same, same[-2:])[0].stdout == b"same\n" * 4
    assert _pump(tmp_path, same[:-1], [*same[-2:], (1, b"end")])[0].stdout == b"same\n" * 3 + b"end"
    # The followed stream saw nothing: the whole tail is the output.
    assert _pump(tmp_path, [], lines)[0].stdout == b'{\n  "a": 1\n}'
    # A tail that does not line up with what was seen adds nothing rather than a duplicate.
    assert _pump(tmp_path, lines, [(1, b"other\n")])[0].stdout == b'{\n  "a": 1\n}'
    # What is added is redacted like the rest.
    o, log = _pump(tmp_path, [(1, b"a\n")], [(1, b"a\n"), (1, b"key sk-pump-secret")])
    assert o.stdout == b"a\nkey ***" and b"sk-pump" not in log


def test_a_routes_429_counted_past_the_kept_request_lines_still_makes_the_run_quota() -> None:
    """The record keeps the first request lines of the gateway's log; a route's statuses are
    counted whole. A 429 that only the counts hold (hundreds of denials logged before it) is the
    gateway's word all the same: quota, as when the line is kept (the counterpart)."""
    from fila.core.models import EgressRecord, EgressRequest, RouteSummary

    e = get_engine("claude")
    failed = out("boom\n")
    kept = EgressRecord(requests=[EgressRequest(door="route", route="anthropic", allowed=True, status=429)])
    assert e.classify_run(1, failed, egress=kept).kind == "quota"
    denials = [EgressRequest(door="proxy", host="denied.test", allowed=False, status=403)] * 500
    counted = EgressRecord(
        requests=denials, routes={"anthropic": RouteSummary(requests=1, statuses={"429": 1})}
    )
    o = e.classify_run(1, failed, egress=counted)
    assert o.kind == "quota" and "HTTP 429 (gateway log)" in o.message, o
    assert e.classify_run(1, failed, egress=EgressRecord(requests=denials)).kind == "engine_error"

"""Engine adapters (claude, codex, opencode, gemini, qwen, aider).

Unit tests read output captured from the REAL CLIs in their real images against the scripted model
server (tests/fixtures/engines/<engine>/*.log, see its README): classification and the report are
proven on what the CLIs really print. The end-to-end tests (marked docker and engines) run each
real CLI in its image through fila and the egress gateway.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fila.engines import get_engine
from fila.models import EgressRecord, EgressRequest, Policy, Task

FIXTURES = Path(__file__).parent / "fixtures" / "engines"


def captured(engine: str, case: str) -> str:
    return (FIXTURES / engine / f"{case}.log").read_text()


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
    ],
)
def test_the_report_holds_what_the_cli_says_about_model_turns_usage_and_cost(
    engine: str, expected: dict[str, object]
) -> None:
    report = get_engine(engine).classify(0, captured(engine, "success")).report
    assert report is not None
    assert {k: report[k] for k in expected} == expected
    assert report["session_id"]


def test_a_tail_cut_mid_line_still_finds_the_result() -> None:
    text = "garbage {not json\n" + captured("claude", "success")
    assert get_engine("claude").classify(0, text[5:]).kind == "success"


def test_without_structured_output_the_text_decides() -> None:
    claude = get_engine("claude")
    assert claude.classify(1, "Error: 429 rate limit reached\n").kind == "quota"
    assert claude.classify(1, "segfault\n").kind == "engine_error"


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
    assert "prevents you from using this specific tool call" in text
    assert get_engine("opencode").classify(0, text).kind == "success"


def test_codex_is_pointed_at_the_gateway_route_with_its_own_provider() -> None:
    inv = get_engine("codex").invocation(task("codex"))
    configs = [inv.argv[i + 1] for i, a in enumerate(inv.argv) if a == "--config"]
    assert 'model_provider="fila"' in configs
    assert 'model_providers.fila.env_key="OPENAI_API_KEY"' in configs
    assert "analytics.enabled=false" in configs
    assert "$OPENAI_BASE_URL" in inv.argv[2]  # filled in the container, where the gateway is known
    assert inv.argv[inv.argv.index("--model") + 1] == "gpt-5.5"


@pytest.mark.parametrize("engine", ["claude", "codex", "opencode"])
def test_a_task_without_a_prompt_is_refused_naming_the_field(engine: str) -> None:
    from fila.errors import InvalidTaskFile

    get_engine(engine).invocation(Task(engine=engine, prompt="x", targets=["a"]))  # the allowed one
    with pytest.raises(InvalidTaskFile) as e:
        get_engine(engine).invocation(Task(engine=engine, prompt="", targets=["a"]))
    assert e.value.field == "prompt"

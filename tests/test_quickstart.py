"""A first real engine task: the shipped vendor policies `fila init` writes, the submit-time refusal
of an engine whose model route its policy does not give, credentials needed only for the routes a
task's engines use (and a gateway holding only those), and the README's "Quick start with a real
engine" run as written: the real claude CLI in its image through the gateway, against the scripted
model server of tests/upstreams (README.md, "Shipped policies", "Network allowlist").
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
from pathlib import Path

import docker
import pytest

from fila.core.layout import Root
from fila.core.models import Task
from fila.egress import config as egress
from fila.engines import engine_names, get_engine
from fila.run.intake import check_task
from fila.workspace import secretscan
from tests.support.cli import FILA_SCRIPT, fila
from tests.support.engines import engine_image
from tests.support.project import make_root, record
from tests.upstreams import Upstreams

README = Path(__file__).parents[1] / "README.md"
VENDORS = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY", "gemini": "GEMINI_API_KEY"}
KEYS = {var: f"sk-test-{name}-{secrets.token_hex(8)}" for name, var in VENDORS.items()}


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in VENDORS.values():
        monkeypatch.delenv(var, raising=False)
    make_root(tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    return tmp_path


def _queued(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "fila" / "in").glob("*.json"))


# -- 1. the shipped policies ------------------------------------------------------------------------


def test_init_writes_a_ready_policy_per_vendor_and_every_ai_engine_has_one(proj: Path) -> None:
    readme = README.read_text()
    covered: dict[str, str] = {}
    for route, var in VENDORS.items():
        doc = json.loads((proj / "policies" / f"{route}.json").read_text())
        assert doc["network"] == "allowlist"
        assert doc["egress"]["routes"] == {route: {"credential": var}}  # the vendor's usual variable
        assert 0 < doc["egress"]["max_requests"] <= 1000 and 0 < doc["egress"]["max_tokens"] <= 50_000_000
        assert doc["default_timeout_ms"] <= doc["max_timeout_ms"] <= 2 * 3600_000
        # The same never-copied rules as the default policy.
        assert doc["deny"] == json.loads((proj / "policies" / "default.json").read_text())["deny"]
        # Documented: the policy, its variable, its engines.
        row = next(ln for ln in readme.splitlines() if ln.startswith(f"| `{route}` |"))
        assert var in row, row
        for name in engine_names():
            if route in get_engine(name).routes:
                covered[name] = route
                assert f"`{name}`" in row, (name, row)
    # Every engine but shell reaches its model through a route a shipped policy gives.
    assert set(covered) == set(engine_names()) - {"shell"}
    # Each loads and accepts its engines' tasks once its key is set.
    for name, route in covered.items():
        os.environ[VENDORS[route]] = KEYS[VENDORS[route]]
        try:
            task = Task(engine=name, prompt="p", targets=["a.txt"], policy=route)
            assert check_task(Root.at(proj), task).policy.egress is not None
        finally:
            del os.environ[VENDORS[route]]


# -- 2. an engine without its route is refused at submit ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "field", "shipped", "refused"),
    [
        (("--engine", "claude"), "engine", "anthropic", "claude"),  # the default policy: network none
        (("--engine", "codex", "--policy", "anthropic"), "engine", "openai", "codex"),  # no such route
        (
            ("--engine", "claude", "--policy", "anthropic", "--fallback", "gemini"),
            "fallback.0",
            "gemini",
            "gemini",
        ),
    ],
)
def test_an_engine_whose_route_the_policy_does_not_give_is_refused_at_submit_naming_the_shipped_policy(
    proj: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], field: str, shipped: str, refused: str
) -> None:
    for var, key in KEYS.items():
        monkeypatch.setenv(var, key)
    res = fila(proj, "submit", "--target", "a.txt", "--prompt", "x", *args)
    assert res.exit_code == 2, res.output
    assert f"field '{field}'" in res.output and "route" in res.output, res.output
    assert f"--policy {shipped}" in res.output and f"policies/{shipped}.json" in res.output, res.output
    assert _queued(proj) == []  # refused, not queued to fail later
    as_json = fila(proj, "submit", "--target", "a.txt", "--prompt", "x", *args, "--json")
    assert json.loads(as_json.stdout)["error"] == "InvalidTaskFile", as_json.output
    # The shipped policy it names takes the refused engine.
    ok = fila(proj, "submit", "--target", "a.txt", "--prompt", "x", "--engine", refused, "--policy", shipped)
    assert ok.exit_code == 0, ok.output


# -- 3. only the credentials of the routes the task's engines use --------------------------------------


def _two_route_policy(root: Path) -> None:
    doc = json.loads((root / "policies" / "anthropic.json").read_text())
    doc["egress"]["routes"]["openai"] = {"credential": "OPENAI_API_KEY"}
    (root / "policies" / "both.json").write_text(json.dumps(doc))


def test_a_task_needs_only_its_engines_keys_and_its_gateway_gets_only_their_routes(
    proj: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _two_route_policy(proj)
    monkeypatch.setenv("OPENAI_API_KEY", KEYS["OPENAI_API_KEY"])  # ANTHROPIC_API_KEY unset
    codex = fila(
        proj, "submit", "--target", "a.txt", "--prompt", "x", "--engine", "codex", "--policy", "both"
    )
    assert codex.exit_code == 0, codex.output
    # claude, or a chain reaching it, needs the anthropic key: refused, naming the variable.
    for args in (("--engine", "claude"), ("--engine", "codex", "--fallback", "claude")):
        res = fila(proj, "submit", "--target", "a.txt", "--prompt", "x", "--policy", "both", *args)
        assert res.exit_code == 2 and "ANTHROPIC_API_KEY is not set" in res.output, res.output
        assert "egress.routes.anthropic.credential" in res.output
    # The shell engine's command may call any route: it needs every key of the policy.
    shell = fila(
        proj, "submit", "--target", "a.txt", "--command", "true", "--engine", "shell", "--policy", "both"
    )
    assert shell.exit_code == 2 and "ANTHROPIC_API_KEY is not set" in shell.output, shell.output

    # What the codex job runs under: the openai route alone, in the gateway's config and secrets,
    # and among the credentials kept out of the review.
    checked = check_task(Root.at(proj), Task(engine="codex", prompt="x", targets=["a.txt"], policy="both"))
    assert checked.policy.egress is not None and list(checked.policy.egress.routes) == ["openai"]
    state = tmp_path_factory.mktemp("gw") / "egress"
    egress.prepare_gateway_dir(
        state, checked.policy, "job", os.getuid(), os.getgid(), clients=["10.0.0.0/24"]
    )
    assert list(json.loads((state / "conf" / "config.json").read_text())["routes"]) == ["openai"]
    assert sorted(p.name for p in (state / "secrets").iterdir()) == ["openai"]
    assert [c.label for c in secretscan.known(checked.policy)] == ["route openai"]
    # With both keys set, a chain from claude to codex gets both routes; each attempt's gateway its own.
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEYS["ANTHROPIC_API_KEY"])
    chain = Task(engine="claude", prompt="x", targets=["a.txt"], policy="both", fallback=["codex"])
    pol = check_task(Root.at(proj), chain).policy
    assert pol.egress is not None and sorted(pol.egress.routes) == ["anthropic", "openai"]
    assert list(egress.only_routes(pol, get_engine("claude").routes).egress.routes) == ["anthropic"]  # type: ignore[union-attr]


# -- the quick start, as the README writes it -----------------------------------------------------------


def quick_start_commands() -> list[list[str]]:
    """The `fila` commands of the README's quick start block, in order."""
    text = README.read_text()
    section = text.split("## Quick start with a real engine", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    out = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line.startswith("fila "):
            out.append(shlex.split(line))
    return out


def test_the_quick_start_is_about_five_commands_from_init_to_apply() -> None:
    cmds = quick_start_commands()
    assert [c[1] for c in cmds] == ["init", "images", "submit", "review", "apply"]
    submit = cmds[2]
    assert (
        submit[submit.index("--engine") + 1] == "claude"
        and submit[submit.index("--policy") + 1] == "anthropic"
    )
    assert "export ANTHROPIC_API_KEY=" in README.read_text().split("## Quick start with a real engine", 1)[1]


def _answering(argv: list[str], cwd: Path, env: dict[str, str], answer: str) -> tuple[int, str]:
    """`argv` with a terminal on stdin (apply asks), answering `answer`."""
    import pty

    primary, secondary = pty.openpty()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=secondary, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        os.write(primary, answer.encode())
        out, _ = proc.communicate(timeout=120)
    finally:
        os.close(primary)
        os.close(secondary)
    return proc.returncode, out


@pytest.mark.docker
@pytest.mark.engines
def test_the_readmes_quick_start_runs_as_written_with_the_key_in_the_usual_variable(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    gateway_image: str,
) -> None:
    engine_image(docker_client, "claude")
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("Teh quick brown fox.\n")
    secret = f"sk-ant-test-{secrets.token_hex(16)}"
    exe = FILA_SCRIPT
    env = {**os.environ, "ANTHROPIC_API_KEY": secret}
    env.pop("FILA_ROOT", None)  # the quick start runs in the project directory
    upstreams.set_script([
        {"protocol": "anthropic", "when": "no_tool_result",
         "reply": {"tool": {"name": "Read", "arguments": {"file_path": "/job/work/README.md"}}}},
        {"protocol": "anthropic", "when": "tool_result",
         "reply": {"tool": {"name": "Edit", "arguments": {"file_path": "/job/work/README.md",
                                                          "old_string": "Teh", "new_string": "The"}}}},
        {"protocol": "anthropic", "when": "tool_result", "reply": {"text": "Fixed the typo."}},
    ])  # fmt: skip
    upstreams.clear_requests()
    for argv in quick_start_commands():
        if argv[1] == "apply":
            code, out = _answering([exe, *argv[1:]], project, env, "y\n")
        else:
            done = subprocess.run([exe, *argv[1:]], cwd=project, env=env, capture_output=True, text=True,
                                  timeout=600)  # fmt: skip
            code, out = done.returncode, done.stdout + done.stderr
        assert code == 0, (argv, out[-3000:])
        if argv[1] == "init":
            # The shipped policy, unchanged but for the upstream this test must reach: the scripted
            # model server on its sealed network, its CA, the egress network that reaches it.
            path = project / "policies" / "anthropic.json"
            doc = json.loads(path.read_text())
            doc["egress"]["routes"]["anthropic"] |= {
                "upstream": "https://model.test",
                "ca_file": str(upstreams.ca_file),
            }
            doc["egress"] |= {"allow_private": [upstreams.subnet], "egress_network": upstreams.network}
            path.write_text(json.dumps(doc))
        if argv[1] == "review":
            assert "-Teh quick brown fox." in out and "+The quick brown fox." in out, out[-3000:]
    assert (project / "README.md").read_text() == "The quick brown fox.\n"
    rec = record(project, "typos")
    assert rec["status"] == "applied" and rec["engine"] == "claude"
    # The key reached the model server from the gateway, never the engine's log or the record.
    got = upstreams.requests("model.test")
    assert len(got) == 3 and all(r["headers"].get("x-api-key") == secret for r in got)
    assert secret not in (project / rec["log_path"]).read_text()
    assert secret not in (project / "fila" / "out" / "typos.json").read_text()

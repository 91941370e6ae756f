"""Engine groups and `fila compare`: `fila submit --engine A --engine B ...`
makes one task per engine in a group on the same input; `fila compare GROUP` (text, --json, --html)
shows them side by side with the task's check; `fila apply` of one marks the others superseded.
A task may pin its image by tag or by image id; the policy's patterns allow or refuse it, and the
record keeps the image id.

The three-engine test runs the real claude, codex and gemini CLIs in their images through the
egress gateway against the scripted model server (tests/upstreams/README.md).
"""

from __future__ import annotations

import io
import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.support.cli import fila, run_once_console
from tests.support.engines import E2E_ENGINES, HELLO, USAGE, engine_image
from tests.support.policy import edit_policy, model_policy, model_route, write_policy
from tests.support.project import make_root, record
from tests.upstreams import Upstreams

KEY_VAR = "FILA_TEST_COMPARE_KEY"
ODD_NAME = "<b>odd.txt"  # a name the HTML page must escape


def _run_once(root: Path, secret: str = "unused") -> subprocess.CompletedProcess[str]:
    return run_once_console(root, {KEY_VAR: secret}, timeout=900)


@pytest.fixture
def group_root(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    gateway_image: str,
) -> Path:
    for engine in ("claude", "codex", "gemini", "shell"):
        engine_image(docker_client, engine)
    make_root(tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    route = model_route(upstreams, KEY_VAR)
    write_policy(
        tmp_path, "models", model_policy(upstreams, {k: route for k in ("anthropic", "openai", "gemini")})
    )
    return tmp_path


def _script() -> list[dict[str, Any]]:
    """claude and codex write hello.txt; gemini writes another file (its check fails)."""
    steps = []
    for engine in ("claude", "codex", "gemini"):
        spec = E2E_ENGINES[engine]
        tool = json.loads(json.dumps(spec.tool))
        if engine == "gemini":
            tool["arguments"]["file_path"] = f"/job/work/{ODD_NAME}"
        steps += [
            {"protocol": spec.protocol, "when": "no_tool_result", "reply": {"tool": tool}, "usage": USAGE[0]},
            {"protocol": spec.protocol, "when": "tool_result", "reply": {"text": "Done."}, "usage": USAGE[1]},
        ]
    return steps


@pytest.mark.docker
@pytest.mark.engines
def test_three_engines_on_one_input_compare_side_by_side_and_applying_one_supersedes_the_others(
    group_root: Path,
    upstreams: Upstreams,
) -> None:
    root, secret = group_root, f"sk-test-{secrets.token_hex(16)}"
    upstreams.set_script(_script())
    upstreams.clear_requests()
    # The check writes a file too: it runs on a copy, so that never reaches the diff.
    check = "touch check-was-here && grep -q 'hello from the model' hello.txt"
    res = fila(
        root,
        *("submit", "--id", "cmp1", "--target", "a.txt", "--policy", "models", "--check", check),
        *("--engine", "claude", "--engine", "codex", "--engine", "gemini"),
        *("--prompt", "Create hello.txt saying hello."),
        env={KEY_VAR: secret},
    )
    assert res.exit_code == 0, res.output
    ids = res.stdout.split()
    assert ids == ["cmp1.claude", "cmp1.codex", "cmp1.gemini"]
    for tid in ids:
        t = record(root, tid)["task"]
        assert (t["group"], t["targets"], t["prompt"], t["check"]) == (
            "cmp1",
            ["a.txt"],
            "Create hello.txt saying hello.",
            check,
        )
    done = _run_once(root, secret)
    recs = {tid: record(root, tid) for tid in ids}
    for tid, rec in recs.items():
        assert rec["status"] == "needs_review", (tid, rec["error"], done.stderr[-2000:])
        assert "check-was-here" not in (root / rec["patch_path"]).read_text()
        assert rec["check"]["command"] == check and rec["check"]["image"]["id"].startswith("sha256:")
    assert [recs[t]["check"]["passed"] for t in ids] == [True, True, False]
    assert recs["cmp1.gemini"]["check"]["exit_code"] == 2  # grep: no hello.txt

    # --json: every column from the records.
    out = fila(root, "compare", "cmp1", "--json")
    assert out.exit_code == 0, out.output
    rows = {r["id"]: r for r in json.loads(out.stdout)["rows"]}
    inp, outp = sum(u["input_tokens"] for u in USAGE), sum(u["output_tokens"] for u in USAGE)
    for tid in ids:
        r = rows[tid]
        assert r["engine"] == tid.split(".")[1] and r["status"] == "needs_review"
        assert (r["requests"], r["input_tokens"], r["output_tokens"], r["tokens_from"]) == (
            2,
            inp,
            outp,
            "gateway",
        )
        assert r["insertions"] == 1 and r["deletions"] == 0 and r["duration_s"] > 0
    assert rows["cmp1.claude"]["files"] == ["hello.txt"] and rows["cmp1.gemini"]["files"] == [ODD_NAME]
    assert [rows[t]["check_passed"] for t in ids] == [True, True, False]
    assert rows["cmp1.claude"]["cost_usd"] is not None  # claude reports its cost; the gateway cannot
    # The terminal table and the self-contained page.
    text = fila(root, "compare", "cmp1")
    assert text.exit_code == 0 and "failed (2)" in text.stdout and text.stdout.count("passed") == 2
    page = fila(root, "compare", "cmp1", "--html").stdout
    assert page.startswith("<!doctype html>") and "default-src 'none'" in page
    assert "&lt;b&gt;odd.txt" in page and ODD_NAME not in page and "<script" not in page
    assert all(tid in page for tid in ids)

    # ALLOWED: applying one member lands it and supersedes the others (recorded: who, when, why).
    app = fila(root, "apply", "cmp1.codex", "--yes", "--by", "ana", "--json")
    assert app.exit_code == 0, app.output
    assert json.loads(app.stdout)["superseded"] == ["cmp1.claude", "cmp1.gemini"]
    assert (root / "hello.txt").read_text() == HELLO and not (root / ODD_NAME).exists()
    for tid in ("cmp1.claude", "cmp1.gemini"):
        rec = record(root, tid)
        assert rec["status"] == "rejected"
        d = rec["decision"]
        assert (d["action"], d["by"], d["reason"]) == (
            "superseded",
            "ana",
            "group cmp1: cmp1.codex was applied",
        )
    assert json.loads(fila(root, "compare", "cmp1", "--json").stdout)["rows"][0]["decision"].startswith(
        "superseded by ana"
    )
    # BLOCKED: a superseded member can no longer be applied, and the project is untouched.
    again = fila(root, "apply", "cmp1.claude", "--yes")
    assert again.exit_code == 4 and "already superseded by ana" in again.output, again.output
    assert (root / "hello.txt").read_text() == HELLO


# -- groups without engines: submit-time refusals and a group of shell tasks ---------------------


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    make_root(tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    # Submit-time cases with model engines: their routes (network none refuses them at submit).
    route = {"credential": KEY_VAR}
    doc = {"network": "allowlist", "max_timeout_ms": 60_000, "default_timeout_ms": 60_000,
           "egress": {"routes": {"anthropic": route, "openai": route}}}  # fmt: skip
    write_policy(tmp_path, "models", doc)
    return tmp_path


def test_a_group_is_checked_whole_before_any_member_is_queued(
    proj: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VAR, "sk-test-submit")
    ok = fila(proj, "submit", "--target", "a.txt", "--engine", "shell", "--engine", "claude",
              "--policy", "models", "--command", "true", "--prompt", "x", "--id", "g1",
              "--model", "claude=claude-x-1")  # fmt: skip
    assert ok.exit_code == 0 and ok.stdout.split() == ["g1.shell", "g1.claude"], ok.output
    # Each engine gets its own model (a model name is one vendor's), the others none.
    assert [record(proj, t)["task"]["model"] for t in ("g1.shell", "g1.claude")] == [None, "claude-x-1"]
    for args, field in [
        (("--engine", "shell", "--engine", "claude", "--model", "codex=gpt-9"), "model"),  # not in the group
        (
            ("--engine", "shell", "--engine", "claude", "--model", "claude=no spaces"),
            "model",
        ),  # claude's option
        (("--engine", "shell", "--engine", "shell"), "engine"),  # an engine named twice
        (("--engine", "shell", "--engine", "nope"), "engine"),  # unknown: nothing is queued
        (("--engine", "shell", "--engine", "claude", "--image", "fila/shell:latest"), "image"),
    ]:
        bad = fila(proj, "submit", "--target", "a.txt", "--command", "true", "--prompt", "x", "--id", "g2",
                   "--policy", "models", *args)  # fmt: skip
        assert bad.exit_code == 2 and f"field '{field}'" in bad.output, bad.output
    dup = fila(proj, "submit", "--target", "a.txt", "--engine", "shell", "--engine", "claude",
               "--policy", "models", "--command", "true", "--prompt", "x", "--id", "g1")  # fmt: skip
    assert dup.exit_code == 4 and "g1.shell" in dup.output
    assert sorted(p.stem for p in (proj / "fila" / "in").glob("*.json")) == ["g1.claude", "g1.shell"]
    one = fila(
        proj, "submit", "--target", "a.txt", "--engine", "claude", "--prompt", "x", "--model", "claude=m"
    )
    assert one.exit_code == 2 and "are for a group" in one.output, one.output
    assert fila(proj, "compare", "g1").exit_code == 0
    assert fila(proj, "compare", "g2").exit_code == 5  # no such group


@pytest.mark.docker
def test_a_task_file_group_with_a_check_runs_on_todays_copy_and_the_record_shows_both(
    proj: Path, shell_image: Any
) -> None:
    """The task-file form: one file (prompt, targets, check) and repeated --engine; here the
    members are shell tasks given as files with the same `group`, the other task-file form."""
    for i, cmd in enumerate(["echo one >> a.txt", "echo two >> a.txt && echo three >> a.txt"]):
        f = proj / f"t{i}.json"
        task = {"id": f"s{i}", "engine": "shell", "command": cmd, "targets": ["a.txt"], "group": "files"}
        f.write_text(json.dumps({**task, "check": "echo counting; test $(wc -l < a.txt) -eq 2"}))
        assert fila(proj, "submit", str(f)).exit_code == 0
    done = _run_once(proj)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["id"]: r for r in json.loads(fila(proj, "compare", "files", "--json").stdout)["rows"]}
    assert (rows["s0"]["insertions"], rows["s0"]["check_passed"]) == (1, True)
    assert (rows["s1"]["insertions"], rows["s1"]["check_passed"], rows["s1"]["check_exit"]) == (2, False, 1)
    log = (proj / record(proj, "s1")["check"]["log_path"]).read_text()
    assert log == "counting\n"  # the check's own log, not the engine's
    shown = fila(proj, "show", "s1").stdout
    assert "group:     files" in shown and "check:     failed (exit 1): echo counting;" in shown


# -- pinned images --------------------------------------------------------------------------------


@pytest.fixture
def other_image(docker_client: docker.DockerClient, shell_image: Any) -> Iterator[str]:
    """An image built here (so outside `fila/*`), from the shell image with one more label."""
    tag = f"h12-test/pinned:{secrets.token_hex(3)}"
    df = io.BytesIO(b"FROM fila/shell:latest\nLABEL fila.test=pinned\n")
    docker_client.images.build(fileobj=df, tag=tag, rm=True, network_mode="none")
    try:
        yield tag
    finally:
        docker_client.images.remove(tag, force=True)


@pytest.mark.docker
def test_a_pinned_image_by_tag_or_id_is_allowed_by_the_policys_patterns_and_the_record_keeps_its_id(
    proj: Path, docker_client: docker.DockerClient, other_image: str
) -> None:
    shell_id = docker_client.images.get("fila/shell:latest").id
    other_id = docker_client.images.get(other_image).id
    edit_policy(proj, "default", to="pinned", images=["fila/*", "h12-test/*"])

    def submit(image: str, *extra: str) -> Any:
        return fila(proj, "submit", "--target", "a.txt", "--engine", "shell", "--command", "echo x >> a.txt",
                    "--image", image, *extra)  # fmt: skip

    # ALLOWED: fila/shell pinned by its image id (the policy judges an id by its tags), and the
    # image built here by tag under the policy that names its repository.
    by_id = submit(shell_id)
    assert by_id.exit_code == 0, by_id.output
    by_tag = submit(other_image, "--policy", "pinned")
    assert by_tag.exit_code == 0, by_tag.output
    # BLOCKED: the same image, by tag or by id, under the default policy (fila/* only).
    for image in (other_image, other_id, other_id.removeprefix("sha256:")[:12]):
        bad = submit(image)
        assert bad.exit_code == 2 and "field 'image'" in bad.output and "not allowed" in bad.output, (
            bad.output
        )
    done = _run_once(proj)
    assert done.returncode == 0, done.stderr[-2000:]
    rec = record(proj, by_id.stdout.strip())
    assert rec["status"] == "needs_review" and rec["image"] == {"tag": shell_id, "id": shell_id}
    rec = record(proj, by_tag.stdout.strip())
    assert rec["status"] == "needs_review" and rec["image"] == {"tag": other_image, "id": other_id}


@pytest.mark.docker
def test_a_member_that_finishes_after_another_was_applied_cannot_be_applied(
    proj: Path, shell_image: Any
) -> None:
    def submit(tid: str, cmd: str) -> None:
        f = proj / f"{tid}.task.json"
        f.write_text(
            json.dumps({"id": tid, "engine": "shell", "command": cmd, "targets": ["a.txt"], "group": "late"})
        )
        assert fila(proj, "submit", str(f)).exit_code == 0

    submit("early", "echo early >> a.txt")
    assert _run_once(proj).returncode == 0
    submit("later", "echo later >> a.txt")  # still queued when "early" is applied: not superseded
    app = fila(proj, "apply", "early", "--yes", "--json")
    assert app.exit_code == 0, app.output
    assert (json.loads(app.stdout)["superseded"], json.loads(app.stdout)["not_superseded"]) == ([], ["later"])
    assert _run_once(proj).returncode == 0
    assert record(proj, "later")["status"] == "needs_review"
    bad = fila(proj, "apply", "later", "--yes")
    assert bad.exit_code == 4 and "whose member early was applied" in bad.output, bad.output
    assert (proj / "a.txt").read_text() == "hello\nearly\n"
    # It can still be rejected: the person decides what to do with it.
    assert fila(proj, "reject", "later").exit_code == 0


@pytest.mark.docker
def test_the_check_has_no_network_even_when_the_engine_had_one_and_its_timeout_is_the_tasks(
    proj: Path, shell_image: Any
) -> None:
    edit_policy(proj, "default", to="bridged", network="bridge")
    # ALLOWED: under `bridge` the engine has an interface besides lo (it only lists them: no traffic).
    net = ("--policy", "bridged", "--id", "net", "--command", "ls /sys/class/net > a.txt")
    seen = fila(
        proj, "submit", "--target", "a.txt", "--engine", "shell", *net, "--check", "ls /sys/class/net"
    )
    assert seen.exit_code == 0, seen.output
    # The check that outlives the task's timeout is stopped and fails; the task stays reviewable.
    slow = fila(proj, "submit", "--target", "a.txt", "--engine", "shell", "--id", "slow", "--timeout", "1500",
                "--command", "echo x >> a.txt", "--check", "sleep 30")  # fmt: skip
    assert slow.exit_code == 0, slow.output
    done = _run_once(proj)
    assert done.returncode == 0, done.stderr[-2000:]
    rec = record(proj, "net")
    patch = (proj / rec["patch_path"]).read_text().splitlines()
    engine_saw = {line[1:] for line in patch if line.startswith("+") and not line.startswith("+++")}
    assert "lo" in engine_saw and engine_saw - {"lo"}, engine_saw
    # BLOCKED: the check, on the same task, sees lo alone (network none).
    assert rec["check"]["passed"] is True
    assert (proj / rec["check"]["log_path"]).read_text().split() == ["lo"]
    rec = record(proj, "slow")
    assert rec["status"] == "needs_review" and rec["diffstat"]["insertions"] == 1
    assert (rec["check"]["timed_out"], rec["check"]["passed"]) == (True, False)
    assert rec["check"]["duration_s"] < 25


def test_a_row_shows_the_engines_a_fallback_tried_and_where_its_tokens_were_counted() -> None:
    from fila.core.models import Attempt, EngineReport, Record, RouteSummary, Task
    from fila.review.groups import Comparison, _row, render_lines

    task = Task(engine="claude", prompt="p", targets=["a.txt"], group="g", fallback=["shell"])
    fell = Record(
        id="g.claude",
        status="needs_review",
        task=task,
        engine="shell",
        attempts=[Attempt(number=1, engine="claude", outcome="quota"), Attempt(number=1, engine="shell")],
        egress={"routes": {"anthropic": RouteSummary(requests=3, input_tokens=10, output_tokens=2)}},
        engine_report=EngineReport(input_tokens=99, cost_usd=0.5),
    )
    row = _row(fell)
    assert row.tried == ["claude(quota)", "shell"]
    assert (row.requests, row.input_tokens, row.output_tokens, row.tokens_from) == (3, 10, 2, "gateway")
    assert row.cost_usd == 0.5  # the CLI's report: the gateway sees tokens, never prices
    # Without the gateway (network none), the CLI's own count, said so.
    alone = _row(fell.model_copy(update={"egress": None}))
    assert (alone.input_tokens, alone.tokens_from, alone.requests) == (99, "cli", None)
    table = render_lines(Comparison("g", "p", ["a.txt"], [row, alone]))
    assert "claude(quota) -> shell" in table[2] and "10/2" in table[2] and "99/-" in table[3]


def test_a_task_file_with_repeated_engine_makes_the_group_from_the_files_fields(
    proj: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VAR, "sk-test-submit")
    f = proj / "task.json"
    f.write_text(json.dumps({"id": "tf", "engine": "shell", "prompt": "Say hi.", "command": "true",
                             "targets": ["a.txt"], "check": "true", "policy": "models"}))  # fmt: skip
    ok = fila(proj, "submit", str(f), "--engine", "shell", "--engine", "codex")
    assert ok.exit_code == 0 and ok.stdout.split() == ["tf.shell", "tf.codex"], ok.output
    tasks = [record(proj, t)["task"] for t in ("tf.shell", "tf.codex")]
    assert [(t["engine"], t["group"], t["prompt"], t["check"]) for t in tasks] == [
        ("shell", "tf", "Say hi.", "true"),
        ("codex", "tf", "Say hi.", "true"),
    ]
    # The same file with one --engine is one task, not a group (the file's id as is).
    one = fila(proj, "submit", str(f), "--engine", "codex")
    assert one.exit_code == 0 and one.stdout.strip() == "tf" and record(proj, "tf")["task"]["group"] is None

"""A real agent CLI as fila's MCP client (issue 38): claude on this host, driven by the tests'
scripted model server, configured with `fila mcp`, calls the submit tool, waits, calls the review
tool, and its final answer carries the diff's summary; the model saw the review's summary and diff
in the tool result claude sent back. claude is the binary of the fila/claude image, copied out; it
runs with the model server, fila's MCP server and a worker in a network namespace of their own
(tests/support/agent.py), so nothing leaves this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import docker
import pytest

import fila
from tests.support.project import make_project

TOOLS = "mcp__fila__submit mcp__fila__wait mcp__fila__review"
ANSWER = "fila task agent-1 is ready for review: 1 file, +1 -0 (greeting.txt gains `bye`)."


def claude_binary(client: docker.DockerClient, dest: Path) -> Path:
    """The claude CLI of the fila/claude image, copied out of a created (never started) container."""
    import io
    import tarfile

    box = client.containers.create("fila/claude:latest")
    try:
        stream, _ = box.get_archive("/usr/local/bin/claude")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            tar.extract("claude", dest, filter="tar")
    finally:
        box.remove(force=True)
    return dest / "claude"


def step(when: str, reply: dict[str, Any]) -> dict[str, Any]:
    return {"protocol": "anthropic", "when": when, "reply": reply}


@pytest.mark.docker
@pytest.mark.engines
@pytest.mark.slow
def test_claude_as_an_mcp_client_submits_waits_and_reads_the_review(
    tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    try:
        docker_client.images.get("fila/claude:latest")
    except docker.errors.ImageNotFound:
        pytest.skip("fila/claude is not built (fila images build claude)")
    claude = claude_binary(docker_client, tmp_path)
    root = make_project(tmp_path / "project")
    work = tmp_path / "agent"
    work.mkdir()
    submit = {
        "engine": "shell",
        "command": "echo bye >> greeting.txt",
        "targets": ["greeting.txt"],
        "prompt": "add bye",
        "task_id": "agent-1",
    }
    script = [
        step("no_tool_result", {"tool": {"name": "mcp__fila__submit", "arguments": submit}}),
        step("tool_result", {"tool": {"name": "mcp__fila__wait", "arguments": {"task_id": "agent-1"}}}),
        step("tool_result", {"tool": {"name": "mcp__fila__review", "arguments": {"task_id": "agent-1"}}}),
        step("tool_result", {"text": ANSWER}),
    ]
    (work / "script.json").write_text(json.dumps(script))
    argv = [
        "unshare",
        "--net",
        sys.executable,
        "-m",
        "tests.support.agent",
        "--claude",
        str(claude),
        "--root",
        str(root.path),
        "--work",
        str(work),
        "--prompt",
        "Add bye to greeting.txt through fila.",
        "--allowed-tools",
        TOOLS,
    ]
    if os.getuid() != 0:  # a namespace of one's own needs a user namespace as well
        argv[1:1] = ["--user", "--map-root-user"]
    try:
        ran = subprocess.run(
            argv, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300
        )
    finally:
        claude.unlink()  # 400 MB: not kept in pytest's retained temp directories
    err = (work / "claude.err").read_text() if (work / "claude.err").exists() else ""
    assert ran.returncode == 0, ran.stdout + ran.stderr + err
    said = json.loads((work / "claude.json").read_text())
    assert said["result"] == ANSWER and not said["is_error"]
    # The model got back, as claude's tool results, the submit's id and the review's summary and diff.
    asked = [json.loads(line) for line in (work / "log" / "requests.jsonl").read_text().splitlines()]
    bodies = [r.get("body", "") for r in asked if r.get("path", "").endswith("/v1/messages")]
    assert len(bodies) == 4
    assert "task      agent-1  (needs_review)" in bodies[-1] and "+bye" in bodies[-1]
    # An ordinary task of the queue, its submitter claude's name as an MCP client.
    rec = fila.Client(root.path).record("agent-1")
    assert rec.status == "needs_review" and rec.task and (rec.task.submitter or "").startswith("mcp:")
    assert rec.task.submitter != "mcp:unknown"

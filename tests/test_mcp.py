"""`fila mcp` (docs/mcp.md) driven by the MCP SDK's own client, over stdio and over streamable
HTTP, against a real fila root: submit, wait, review, apply; the task an ordinary task of the
queue (`fila show` prints it, with the client's name as its submitter). Every hostile argument
beside its allowed counterpart: targets outside the root (`..`, absolute), a deny-listed path, a
policy not allowed for MCP, an oversized prompt, a path-like task id, another root's task, apply
without --allow-decide, an unknown tool, malformed JSON-RPC, HTTP without the bearer token.

The fake backend (no containers) runs the tasks, in this process through the API (fila.Client,
as a worker beside the server would); one test runs its task in a real Docker container.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mcp import Client as McpClient
from mcp import StdioServerParameters
from mcp_types import Implementation

import fila
from fila.core.layout import Root
from tests.support.project import GREETING, make_project, make_root

AGENT = Implementation(name="fila-test-agent", version="1")
CLI = [sys.executable, "-m", "fila"]
TOKEN = "t0ken-for-the-tests-0123456789"


def env_of(base: Path, *, backend: str | None = "fake") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FILA_", "PG"))}
    if backend:
        env.update({"FILA_BACKEND": backend, "FILA_FAKE_DIR": str(base / "boxes")})
    return env


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Root:
    """A root with greeting.txt, a deny-listed .env, and a policy `small` (a 64-byte prompt cap)."""
    root = make_project(tmp_path / "project", {".env": "SECRET=1\n", "sub/a.txt": "a\n"})
    small = json.loads((root.path / "policies" / "default.json").read_text())
    (root.path / "policies" / "small.json").write_text(json.dumps({**small, "max_prompt_bytes": 64}))
    for k, v in env_of(tmp_path).items():
        if k.startswith("FILA_"):
            monkeypatch.setenv(k, v)
    return root


def stdio(root: Root, *flags: str, backend: str | None = "fake") -> McpClient:
    args = ["-m", "fila", "mcp", "--root", str(root.path), *flags]
    params = StdioServerParameters(
        command=sys.executable, args=args, env=env_of(root.path.parent, backend=backend)
    )
    return McpClient(params, client_info=AGENT)


def result(res: Any) -> dict[str, Any]:
    assert not res.is_error, res.content[0].text
    return json.loads(res.content[0].text)


async def refused(c: McpClient, tool: str, args: dict[str, Any], said: str) -> None:
    res = await c.call_tool(tool, args)
    assert res.is_error and said in res.content[0].text, res.content[0].text


def ran(root: Root, tid: str) -> None:
    """A worker's run of the task, here through the API (the fake backend, or Docker)."""
    with fila.Client(root.path) as c:
        assert c.run([tid]).code == 0


async def cycle(c: McpClient, root: Root) -> str:
    """submit, wait (not yet, then settled), review, apply: what an agent does; returns the id."""
    cmd = "echo said-bye; echo bye >> greeting.txt"
    args = {"engine": "shell", "targets": ["greeting.txt"], "prompt": "add bye", "command": cmd}
    got = result(await c.call_tool("submit", args))
    tid = got["id"]
    assert got["status"] == "queued" and got["submitter"] == "mcp:fila-test-agent"
    waited = result(await c.call_tool("wait", {"task_id": tid, "timeout_s": 0.2}))
    assert (waited["status"], waited["settled"]) == ("queued", False)
    await asyncio.to_thread(ran, root, tid)
    waited = result(await c.call_tool("wait", {"task_id": tid, "timeout_s": 30}))
    assert (waited["status"], waited["settled"], waited["diffstat"]["insertions"]) == (
        "needs_review",
        True,
        1,
    )
    rv = result(await c.call_tool("review", {"task_id": tid}))
    assert rv["verified"] and "+bye\n" in rv["diff"] and f"task      {tid}  (needs_review)" in rv["summary"]
    assert [f["path"] for f in rv["files"]] == ["greeting.txt"]
    assert all("fake backend" in w for w in rv["warnings"])  # the only warning: no container ran it
    assert "said-bye" in result(await c.call_tool("log", {"task_id": tid}))["log"]
    assert (root.path / "greeting.txt").read_text() == GREETING  # nothing landed before apply
    applied = result(await c.call_tool("apply", {"task_id": tid, "reason": "looks\x1b[2J right\u202e"}))
    assert applied["status"] == "applied" and applied["decision"]["by"] == "mcp:fila-test-agent"
    assert applied["project"] == "."  # the root's path, relative to the root: no host layout
    with fila.Client(root.path) as person:  # the reason as recorded: an agent's words, made inert
        assert (d := person.record(tid).decision) and d.reason == "looks\\x1b[2J right\\u202e"
    assert (root.path / "greeting.txt").read_text() == GREETING + "bye\n"
    await refused(c, "apply", {"task_id": tid}, "already applied by mcp:fila-test-agent")
    return tid


def test_an_agent_over_stdio_submits_waits_reviews_and_applies_an_ordinary_task(project: Root) -> None:
    with fila.Client(project.path) as person:  # a person's task: a person decides it
        theirs = person.submit(engine="shell", command="true", targets=["greeting.txt"], submitter="ann").id

    async def go() -> str:
        async with stdio(project, "--allow-decide") as c:
            names = {t.name for t in (await c.list_tools()).tools}
            assert names == {"submit", "wait", "status", "review", "log", "compare", "apply", "reject"}
            for tool in ("apply", "reject"):
                await refused(c, tool, {"task_id": theirs}, "was not submitted through MCP (submitter ann)")
            tid = await cycle(c, project)
        await asyncio.to_thread(ran, project, theirs)
        async with stdio(project, "--allow-decide", "--decide-any") as c:
            assert result(await c.call_tool("reject", {"task_id": theirs}))["status"] == "rejected"
        return tid

    tid = asyncio.run(go())
    # An ordinary task of the queue: the CLI shows it, its submitter the MCP client's name.
    shown = subprocess.run([*CLI, "show", tid, "--root", str(project.path)], capture_output=True, text=True,
                           env=env_of(project.path.parent), timeout=60)  # fmt: skip
    assert shown.returncode == 0 and "submitter: mcp:fila-test-agent" in shown.stdout, shown.stderr
    assert "status:    applied" in shown.stdout


def test_an_agents_waits_and_live_tasks_are_capped_and_waits_hold_no_tool(project: Root) -> None:
    async def go() -> None:
        async with stdio(project, "--max-live-tasks", "2") as c:
            args = {"engine": "shell", "command": "true", "targets": ["greeting.txt"]}
            tid = result(await c.call_tool("submit", args))["id"]
            # Two of this server's tasks queued: a third submit is refused until one has run.
            other = result(await c.call_tool("submit", args))["id"]
            await refused(
                c, "submit", args, "2 tasks submitted through this MCP server are queued or running"
            )
            now = {"task_id": tid, "timeout_s": 0}
            assert result(await c.call_tool("wait", now))["settled"] is False  # alone, a wait is served
            # Without --policy, only `default` may be named: no task spends the operator's model keys.
            await refused(c, "submit", {**args, "policy": "openai"}, "not allowed for MCP (allowed: default)")
            hold = {"task_id": tid, "timeout_s": 300}
            long = [asyncio.create_task(c.call_tool("wait", hold)) for _ in range(4)]
            # Beside four waits in progress a fifth is refused at once, and other tools are served.
            deadline = time.monotonic() + 60
            while not (fifth := await c.call_tool("wait", now)).is_error:
                assert time.monotonic() < deadline and json.loads(fifth.content[0].text)["settled"] is False
            assert "4 waits of this client are in progress: at most 4" in fifth.content[0].text
            assert result(await c.call_tool("status", {"task_id": tid}))["status"] == "queued"
            await asyncio.to_thread(ran, project, tid)
            assert all(result(w)["settled"] for w in await asyncio.gather(*long))
            assert result(await c.call_tool("wait", now))["settled"]
            assert result(await c.call_tool("submit", args))["id"] not in (tid, other)

    asyncio.run(go())


def test_every_hostile_argument_is_refused_beside_its_allowed_counterpart(
    project: Root, tmp_path: Path
) -> None:
    other = make_root(tmp_path / "other")  # another root, with a task of its own
    with fila.Client(other.path) as c:
        (other.path / "x.txt").write_text("x\n")
        c.submit(engine="shell", command="true", targets=["x.txt"], id="theirs")

    async def go() -> None:
        base = {"engine": "shell", "command": "true"}
        async with stdio(project, "--policy", "default", "--policy", "small") as c:
            # apply and reject are not offered without --allow-decide: an unknown tool, like any other.
            names = {t.name for t in (await c.list_tools()).tools}
            assert names == {"submit", "wait", "status", "review", "log", "compare"}
            for tool in ("apply", "reject", "no-such-tool"):
                await refused(c, tool, {"task_id": "x"}, f"Unknown tool: {tool}")
            # Targets: inside the project and not denied, as a task file's.
            ok = result(await c.call_tool("submit", {**base, "targets": ["greeting.txt", "sub/a.txt"]}))
            # An id of the agent's choosing: checked as any task id, and never queued twice.
            mine = {**base, "targets": ["greeting.txt"], "task_id": "mine"}
            assert result(await c.call_tool("submit", mine))["id"] == "mine"
            await refused(c, "submit", mine, "task id 'mine' exists already")
            for bad, said in (("../x", "field 'id'"), ("/etc/x", "field 'id'"), ("..", "invalid task id")):
                await refused(c, "submit", {**mine, "task_id": bad}, said)
            inside = str(project.path / "greeting.txt")
            outside = ["../outside", "sub/../../x", "sub/../.env", inside, "/etc/passwd"]
            for bad, said in [
                *((t, "outside the project") for t in outside),
                (".env", "never copied (deny rule"),
            ]:
                await refused(c, "submit", {**base, "targets": [bad]}, said)
            # Policies: only those the operator allowed here, whatever the root holds.
            assert result(
                await c.call_tool("submit", {**base, "targets": ["greeting.txt"], "policy": "small"})
            )
            for name in ("openai", "anthropic", "../default", "nope"):
                await refused(c, "submit", {**base, "targets": ["greeting.txt"], "policy": name},
                              "not allowed for MCP (allowed: default, small)")  # fmt: skip
            # The prompt: within the policy's cap (64 bytes for `small`), one byte more refused.
            fits = {**base, "targets": ["greeting.txt"], "policy": "small", "prompt": "p" * 64}
            fit = result(await c.call_tool("submit", fits))
            # What a record holds comes back as it is, but escaped and capped when it is not plain text.
            assert result(await c.call_tool("status", {"task_id": fit["id"]}))["task"]["prompt"] == "p" * 64
            odd = "\x1b[31mred\u202e" + "p" * 20000
            tid = result(await c.call_tool("submit", {**base, "targets": ["greeting.txt"], "prompt": odd}))[
                "id"
            ]
            prompt = result(await c.call_tool("status", {"task_id": tid}))["task"]["prompt"]
            assert (
                prompt.startswith("\\x1b[31mred\\u202epp") and "\x1b" not in prompt and "\u202e" not in prompt
            )
            assert len(prompt) < 17000 and prompt.endswith("(cut: 20009 characters, at most 16384)")
            await refused(
                c,
                "submit",
                {**fits, "prompt": "p" * 65},
                "the prompt is 65 bytes, above policy 'small''s max_prompt_bytes 64",
            )
            # Fields the tool has not (an image, limits, a project elsewhere, an id) are not accepted.
            for extra in ({"project": str(other.path)}, {"image": "alpine"}, {"limits": {"memory": "64g"}}):
                await refused(
                    c, "submit", {**base, "targets": ["greeting.txt"], **extra}, "takes no argument"
                )
            assert not (other.path / "fila" / "in" / "x.json").exists()
            # Task ids: this root's tasks only, never a path.
            assert result(await c.call_tool("status", {"task_id": ok["id"]}))["status"] == "queued"
            no_host_path = "no task 'theirs' in fila/out\n"
            await refused(c, "status", {"task_id": "theirs"}, no_host_path)
            # Arguments the schema refuses: said in fila's words, not the validator's dump of the input.
            await refused(c, "status", {"task_id": "x" * 128}, f"no task '{'x' * 128}'")
            res = await c.call_tool("status", {"task_id": "y" * 129})
            said = res.content[0].text
            assert said.endswith("fila: error: argument 'task_id': String should have at most 128 characters")
            assert "yyy" not in said and "pydantic" not in said
            for bad in ("../other/fila/out/theirs", "/etc/passwd", ".."):
                await refused(c, "status", {"task_id": bad}, "invalid task id")
                await refused(c, "log", {"task_id": bad}, "invalid task id")

    asyncio.run(go())
    ls = [*CLI, "ls", "--json", "--root", str(project.path)]
    listed = json.loads(subprocess.run(ls, capture_output=True, env=env_of(tmp_path), timeout=60).stdout)
    assert len(listed) == 5  # the five accepted submits, nothing of the refused ones


def test_malformed_json_rpc_is_answered_or_dropped_and_the_server_goes_on(project: Root) -> None:
    lines = [
        b"{not json\n",
        b"[1, 2]\n",
        b'{"jsonrpc": "2.0", "id": 7, "method": "no/such/method"}\n',
        b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18",'
        b'"capabilities":{},"clientInfo":{"name":"raw bot\\u202e","version":"0"}}}\n',
        b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n',
        b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"submit","arguments":"x"}}\n',
        b'{"jsonrpc":"2.0","id":3,"method":"tools/list"}\n',
        # A second initialize (another name, mid-session) is refused: the name is the first one's.
        b'{"jsonrpc":"2.0","id":4,"method":"initialize","params":{"protocolVersion":"2025-06-18",'
        b'"capabilities":{},"clientInfo":{"name":"person","version":"0"}}}\n',
        b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"submit","arguments":'
        b'{"engine":"shell","command":"true","targets":["greeting.txt"]}}}\n',
    ]
    argv = [*CLI, "mcp", "--root", str(project.path)]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env_of(project.path.parent)
    )
    assert proc.stdin and proc.stdout
    proc.stdin.write(b"".join(lines))
    proc.stdin.flush()
    answers: dict[int, Any] = {}
    try:
        while set(answers) != {1, 2, 3, 4, 5, 7}:  # stdin stays open: the server answers what came, in turn
            line = proc.stdout.readline()
            assert line, "the server ended before answering"
            answers[json.loads(line)["id"]] = json.loads(line)
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert answers[7]["error"]["code"] == -32601 and answers[2]["error"]["code"] == -32602
    assert answers[1]["result"]["serverInfo"]["name"] == "fila"
    assert "submit" in {t["name"] for t in answers[3]["result"]["tools"]}  # still serving after all that
    assert answers[4]["error"]["code"] == -32600 and "initialized already" in answers[4]["error"]["message"]
    queued = json.loads(answers[5]["result"]["content"][0]["text"])  # named by its first initialize, safely
    assert queued["submitter"] == "mcp:raw_bot_"
    assert proc.returncode == 0 and [p.stem for p in (project.path / "fila" / "out").glob("*.json")] == [
        queued["id"]
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_agent_over_http_needs_the_token_and_runs_the_cycle(project: Root, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    link = tmp_path / "link"
    link.symlink_to(token)
    token.chmod(0o644)  # readable by others: refused, as a password file would be
    port = free_port()
    base = [*CLI, "mcp", "--root", str(project.path), "--http", f"127.0.0.1:{port}"]
    loose = subprocess.run([*base, "--token-file", str(token)], capture_output=True, text=True,
                           env=env_of(tmp_path), timeout=60)  # fmt: skip
    assert loose.returncode == 2 and "readable by no one else" in loose.stderr, loose.stderr
    token.chmod(0o600)
    linked = subprocess.run([*base, "--token-file", str(link)], capture_output=True, text=True,
                            env=env_of(tmp_path), timeout=60)  # fmt: skip
    assert linked.returncode == 2 and "without following a link" in linked.stderr, linked.stderr
    # No token given: one is generated into the root's state (mode 0600) and required, on loopback too.
    server = subprocess.Popen(
        [*base, "--allow-decide"], env=env_of(tmp_path), stderr=subprocess.PIPE, text=True
    )
    assert server.stderr
    url = f"http://127.0.0.1:{port}/mcp"
    made = project.fila / "state" / "mcp.token"
    try:
        said = server.stderr.readline() + server.stderr.readline()
        assert f"the bearer token is in {made}" in said and f"serving {url}" in said, said
        assert made.stat().st_mode & 0o777 == 0o600
        generated = made.read_text().strip()
        # The port is taken: the operator's token file is read, the bind refused, and nothing says "serving".
        taken = subprocess.run([*base, "--token-file", str(token)], capture_output=True, text=True,
                               env=env_of(tmp_path), timeout=60)  # fmt: skip
        assert taken.returncode == 2 and "cannot listen" in taken.stderr and "serving" not in taken.stderr

        def post(data: bytes, auth: str | None) -> int:
            accept = "application/json, text/event-stream"
            headers = {"Content-Type": "application/json", "Accept": accept}
            req = urllib.request.Request(url, data=data, method="POST", headers=headers)
            if auth:
                req.add_header("Authorization", auth)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        for auth in (None, "Bearer wrong-token-0123456789", f"Basic {generated}", f"Bearer {TOKEN}"):
            assert post(b"{}", auth) == 401
        # With the token (the scheme's name in any case), malformed JSON-RPC is answered 400, not served.
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert post(b"{not json", f"{scheme} {generated}") == 400

        async def go() -> None:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {generated}"}, timeout=60)
            async with McpClient(streamable_http_client(url, http_client=http), client_info=AGENT) as c:
                await cycle(c, project)

        asyncio.run(go())
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.docker
def test_an_agent_over_stdio_gets_a_diff_made_in_a_real_container(
    project: Root, shell_image: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> None:
        async with stdio(project, "--allow-decide", backend=None) as c:
            await cycle(c, project)

    monkeypatch.delenv("FILA_BACKEND")  # the root's own backend: Docker
    asyncio.run(go())
    with fila.Client(project.path) as c:
        [rec] = [r for r in c.listing().records]
    assert rec.backend == "docker" and rec.container_started

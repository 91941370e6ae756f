"""A real agent CLI as fila's MCP client (tests/test_mcp_agent.py): claude on this host, its model
the tests' scripted model server (tests/upstreams/modelserver.py), its MCP server `fila mcp`, a
`fila worker` beside it on the fake backend.

Run as `unshare --net python -m tests.support.agent ...`: every process here lives in a network
namespace of its own whose only link is loopback, so nothing claude (or anything it starts) sends
can leave this machine. Writes claude's stdout to WORK/claude.json and exits with claude's code.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PORT = 8080


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--claude", type=Path, required=True)
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--allowed-tools", required=True)
    a = ap.parse_args()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(REPO),
        "FILA_BACKEND": "fake",
        "FILA_FAKE_DIR": str(a.work / "boxes"),
    }
    log = a.work / "log"
    log.mkdir(exist_ok=True)
    model = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests/upstreams/modelserver.py"),
            "--mode",
            "model",
            "--name",
            "model.test",
            "--http-port",
            str(PORT),
            "--script",
            str(a.work / "script.json"),
            "--log-dir",
            str(log),
        ],
        env=env,
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "fila", "worker", "--root", str(a.root), "--poll", "0.2"],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 30
        while not (log / "ready").exists():
            assert time.monotonic() < end and model.poll() is None, "the model server did not start"
            time.sleep(0.05)
        mcp = {
            "mcpServers": {
                "fila": {
                    "command": sys.executable,
                    "args": ["-m", "fila", "mcp", "--root", str(a.root)],
                    "env": env,
                }
            }
        }
        (a.work / "mcp.json").write_text(json.dumps(mcp))
        home = a.work / "home"
        home.mkdir(exist_ok=True)
        claude_env = {
            **env,
            "HOME": str(home),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{PORT}",
            "ANTHROPIC_API_KEY": "sk-ant-placeholder-not-a-key",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
        }
        argv = [
            str(a.claude),
            "-p",
            a.prompt,
            "--output-format",
            "json",
            "--model",
            "claude-sonnet-4-5",
            "--mcp-config",
            str(a.work / "mcp.json"),
            "--strict-mcp-config",
            "--allowedTools",
            a.allowed_tools,
        ]
        done = subprocess.run(argv, env=claude_env, cwd=a.root, capture_output=True, timeout=240)
        (a.work / "claude.json").write_bytes(done.stdout)
        (a.work / "claude.err").write_bytes(done.stderr)
        return done.returncode
    finally:
        for p in (worker, model):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())

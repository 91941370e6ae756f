"""Project environments end to end on Docker (docs/environments.md): a project's
`.devcontainer/devcontainer.json` set up once through the gateway from a local package index
(pypi.test, tests/support/pkgindex.py: nothing leaves the machine), the check run in the project's
own toolchain, the second task on the cached environment, and what a setup may not do.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import pytest

from fila.core.layout import Root
from tests.support.cli import fila, fila_process
from tests.support.policy import write_policy
from tests.support.project import make_root, record

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _no_environment_left(docker_client: Any) -> Iterator[None]:
    """What a test's environments leave in the engine (images, engine layers, volumes) is removed
    after it: a later run must build its own, never find one of a run before by its key."""
    before_images = {i.id for i in docker_client.images.list(filters={"label": "fila.env"})}
    before_volumes = {v.name for v in docker_client.volumes.list(filters={"label": "fila.env.key"})}
    yield
    for image in docker_client.images.list(filters={"label": "fila.env"}):
        if image.id not in before_images:
            with contextlib.suppress(docker.errors.APIError):
                docker_client.images.remove(image.id, force=True)
    for volume in docker_client.volumes.list(filters={"label": "fila.env.key"}):
        if volume.name not in before_volumes:
            with contextlib.suppress(docker.errors.APIError):
                volume.remove(force=True)


CALC = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
FIX = "sed -i 's/a - b/a + b/' calc.py"
VENV_PATH = "/job/work/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def devcontainer(idx: Any, **over: Any) -> dict[str, Any]:
    """A Python project's declaration: the project's own image (fila/testenv), a virtualenv in
    the project tree made by the setup from pypi.test, and on PATH for the engine and the check."""
    doc = {
        "name": "calc",
        "image": idx.testenv_image,
        # The tools' caches (bytecode, pytest's) are fila's to keep out of work/: nothing here.
        "containerEnv": {**idx.pip_env, "PATH": VENV_PATH},
        "onCreateCommand": "python3 -m venv .venv",
        "postCreateCommand": [".venv/bin/pip", "install", "-q", "-r", "requirements.txt"],
        "customizations": {"fila": {"inputs": ["requirements.txt"], "provided": [".venv"]}},
        "forwardPorts": [8000],
    }
    return doc | over


def python_project(tmp_path: Path, idx: Any, **over: Any) -> Root:
    root = make_root(tmp_path / "calc")
    files = {"calc.py": CALC, "test_calc.py": TEST, "requirements.txt": "pytest\n"}
    for rel, text in files.items():
        (root.path / rel).write_text(text)
    (root.path / ".devcontainer").mkdir()
    # JSONC, as editors write it: a comment and a trailing comma.
    body = json.dumps(devcontainer(idx, **over), indent=2)
    (root.path / ".devcontainer" / "devcontainer.json").write_text(
        "// the project's toolchain\n" + body[:-2] + ",\n}\n"
    )
    return root


def setup_policy(root: Root, idx: Any, allow: list[dict[str, Any]] | None = None, **env: Any) -> None:
    """The default policy (engine: network none) with a setup that reaches `allow` (pypi.test) on
    the upstreams' sealed network through its gateway."""
    doc = json.loads((root.path / "policies" / "default.json").read_text())
    doc["environment"] = {
        "allow": idx.allow() if allow is None else allow,
        "allow_private": [idx.subnet],
        "egress_network": idx.network,
        "timeout_ms": 300_000,
        **env,
    }
    write_policy(root, "default", doc)


def submit_run(root: Root, command: str, *extra: str) -> dict[str, Any]:
    res = fila(root, "submit", "--engine", "shell", "--command", command, "--target", ".", *extra, "--run")
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert lines, res.output
    tid = lines[0].split()[0]
    rec = record(root, tid)
    rec["_output"] = res.output
    return rec


@pytest.mark.engines
def test_a_python_project_is_set_up_once_its_check_runs_in_it_and_claude_fixes_the_code_there(
    tmp_path: Path, pkgindex: Any, upstreams: Any, gateway_image: str
) -> None:
    """One environment build for both (each is the other's setup): fila's own tasks and check on
    it, then Claude Code on the same environment (claude_fixes_it)."""
    root = python_project(tmp_path, pkgindex)
    setup_policy(root, pkgindex)
    # The first task builds the environment; its check runs pytest from the setup's .venv and
    # sees the real failure (nothing was fixed): the check is honest.
    first = submit_run(root, "true", "--check", "pytest -q")
    env = first["environment"]
    assert first["status"] == "needs_review", first
    assert env["how"] == "built" and env["source"] == ".devcontainer/devcontainer.json", env
    assert first["check"]["passed"] is False and first["check"]["exit_code"] == 1
    assert "1 failed" in (root.path / first["check"]["log_path"]).read_text()
    # `fila submit` pinned what the environment is made of; the run made the same.
    assert first["task"]["environment_digest"] == env["digest"] == env["pinned"], env
    # What the setup's gateway let out: pypi.test only, every request allowed.
    reqs = env["egress"]["requests"]
    assert reqs and {r["host"] for r in reqs} == {"pypi.test"} and env["egress"]["denied"] == 0, env["egress"]
    pkgindex.logged("pypi.test", "/simple/pytest/")
    assert any("forwardPorts" in w for w in env["warnings"]), env["warnings"]  # ignored, and said
    assert "== fila setup: postCreateCommand" in (root.path / env["log_path"]).read_text()
    # The second task finds it by its key: no setup, and the fix passes the same check.
    second = submit_run(root, FIX, "--check", "pytest -q")
    assert second["status"] == "needs_review", second
    assert second["environment"]["how"] == "cached" and second["environment"]["key"] == env["key"]
    assert second["check"]["passed"] is True, second["check"]
    assert "environment" in second["timings"] and "building" not in second["_output"]
    # The provided .venv is neither copied into the job nor in the diff.
    patch = (root.path / second["patch_path"]).read_text()
    assert "calc.py" in patch and ".venv" not in patch
    assert second["diffstat"]["paths"] == ["calc.py"]
    # `fila review` shows the environment.
    shown = fila(root, "review", second["id"]).stdout
    assert "env       calc (.devcontainer/devcontainer.json, devcontainer)" in shown and "cached" in shown
    # (A changed lockfile is a new key: tests/test_env_key.py; a new key builds as above.)
    # A task submitted for another environment (a submitter whose base image differs) is refused
    # on this host before any setup or engine: it never runs in an environment it was not meant for.
    task = {"engine": "shell", "command": FIX, "targets": ["."], "id": "elsewhere"}
    (tmp_path / "elsewhere.json").write_text(json.dumps(task | {"environment_digest": "0" * 64}))
    fila(root, "submit", str(tmp_path / "elsewhere.json"), "--run")
    other = record(root, "elsewhere")
    assert other["status"] == "failed" and other["error"]["kind"] == "environment", other
    assert "submitted for an environment made of 000000000000" in other["error"]["message"], other["error"]
    assert other["environment"]["digest"] == env["digest"] and not other["container_started"], other
    # The same project, unfixed (a patch waits for review), by Claude Code on the cached environment.
    claude_fixes_it(root, pkgindex, upstreams)


def test_a_setup_that_reaches_an_unlisted_host_fails_its_task_before_any_engine(
    tmp_path: Path, pkgindex: Any
) -> None:
    """The allowed counterpart is the test above (pypi.test listed). Here the setup may reach only
    npm.test: pip's requests to pypi.test are refused by the gateway and logged, the task fails
    with kind `environment`, naming the host, and no engine container ever starts."""
    root = python_project(tmp_path, pkgindex)
    npm_only = [a for a in pkgindex.allow() if a["host"] == "npm.test"]
    assert npm_only
    setup_policy(root, pkgindex, allow=npm_only)
    rec = submit_run(root, "echo engine ran > ran.txt")
    assert rec["status"] == "failed" and rec["error"]["kind"] == "environment", rec
    assert "pypi.test:8080" in rec["error"]["message"]
    env = rec["environment"]
    assert env["how"] == "failed" and env["egress"]["denied"] > 0
    assert not rec["container_started"] and not rec["attempts"][0].get("exit_code")
    assert not (root.path / "ran.txt").exists()


def _setup_fails(tmp_path: Path, idx: Any, name: str, command: str, **env: Any) -> dict[str, Any]:
    root = make_root(tmp_path / name)
    (root.path / "fila-environment.json").write_text(
        json.dumps({"image": idx.testenv_image, "setup": [{"name": name, "shell": command}]})
    )
    setup_policy(root, idx, allow=[], **env)
    return submit_run(root, "true")


@pytest.mark.parametrize(
    ("name", "command", "limits", "says"),
    [
        ("exits", "echo broken >&2; exit 3", {}, "exited with code 3"),
        ("hangs", "sleep 600", {"timeout_ms": 3000}, "timed out after 3 s"),
        ("forks", "while :; do sleep 60 & done", {"pids": 64, "timeout_ms": 20_000}, "exited with code"),
        ("fills", "head -c 200000000 /dev/zero > /opt/big; sleep 30", {"max_image_bytes": 50_000_000}, "max_image_bytes"),  # noqa: E501
        # Written and exited between two measures: measured once more before it is committed.
        ("fills-fast", "head -c 100000000 /dev/zero > /opt/big", {"max_image_bytes": 50_000_000}, "max_image_bytes"),  # noqa: E501
    ],
)  # fmt: skip
def test_a_setup_that_fails_ends_its_task_with_its_log_and_no_engine(
    tmp_path: Path, pkgindex: Any, name: str, command: str, limits: dict[str, Any], says: str
) -> None:
    rec = _setup_fails(tmp_path, pkgindex, name, command, **limits)
    assert rec["status"] == "failed" and rec["error"]["kind"] == "environment", rec
    assert says in rec["error"]["message"], rec["error"]
    assert rec["environment"]["log_path"] and not rec["container_started"]


def test_a_setup_that_succeeds_under_the_same_limits_is_built(tmp_path: Path, pkgindex: Any) -> None:
    """The counterpart of the failures above: the same form and limits, a setup that ends."""
    rec = _setup_fails(
        tmp_path, pkgindex, "ok", "head -c 1000 /dev/zero > /opt/small", pids=64, timeout_ms=20_000
    )
    assert rec["status"] == "needs_review" and rec["environment"]["how"] == "built", rec


def test_a_base_image_the_policy_does_not_allow_is_refused(tmp_path: Path, pkgindex: Any) -> None:
    root = python_project(tmp_path, pkgindex)
    setup_policy(root, pkgindex)
    doc = json.loads((root.path / "policies" / "default.json").read_text())
    write_policy(root, "default", doc | {"images": ["fila/shell*"]})
    rec = submit_run(root, "true")
    assert rec["status"] == "failed" and rec["error"]["kind"] == "environment"
    assert "not allowed by the policy" in rec["error"]["message"]


class HostUdp:
    """A UDP service of the host bound to [::]: what it received (it answers each datagram)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        self.sock.bind(("::", 0))
        self.sock.settimeout(120)
        self.port = self.sock.getsockname()[1]
        self.got: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            data, addr = self.sock.recvfrom(4096)
            self.got.append(data)
            self.sock.sendto(b"answer-of-the-host-service", addr)


def test_a_project_dockerfile_is_built_through_the_setups_gateway(tmp_path: Path, pkgindex: Any) -> None:
    """Built from a context fila assembles: what no job is given (.env, .git/) is not in it either.
    Its RUN steps reach the setup's allowlist through a gateway of the build's own (pip fetches
    from pypi.test), and a host the allowlist does not list is refused and logged (npm.test); with
    no allowlist, no network; a build past the setup's timeout fails.
    A RUN step keeps Docker's default NET_RAW (the classic builder sets no capabilities): on its
    gateway's job network the host is closed to its bridge, so raw frames find no host address
    (tests/fixtures/raw_v6_probe.txt): a service of the host bound to [::] hears nothing, in the
    same build whose pip reached pypi.test through the gateway."""
    root = make_root(tmp_path / "df")
    dc = root.path / ".devcontainer"
    dc.mkdir()
    shutil.copy(Path(__file__).parent / "fixtures" / "raw_v6_probe.txt", dc / "probe.py")
    fetch = f"pip download -q --no-deps -d /opt/wheels -i {pkgindex.pypi_url} --trusted-host pypi.test six"
    host = HostUdp()
    steps = ["RUN echo from-dockerfile > /opt/marker", f"RUN {fetch}", "COPY . /opt/ctx",
             f"RUN python3 /opt/ctx/.devcontainer/probe.py {host.port} | tee /opt/probe.txt"]  # fmt: skip
    (dc / "Dockerfile").write_text("\n".join([f"FROM {pkgindex.testenv_image}", *steps, ""]))
    (dc / "devcontainer.json").write_text(
        json.dumps({"build": {"dockerfile": "Dockerfile", "context": ".."}})
    )
    (root.path / ".env").write_text("TOKEN=secret\n")
    (root.path / ".git").mkdir()
    (root.path / ".git" / "config").write_text("[remote]\n")
    (root.path / "kept.txt").write_text("kept\n")
    setup_policy(root, pkgindex, allow=[pkgindex.allow()[0]])  # pypi.test only
    try:
        rec = submit_run(
            root,
            "cat /opt/marker > out.txt; ls -A /opt/ctx > ctx.txt; ls /opt/wheels > whl.txt; "
            "cat /opt/probe.txt > probe.txt",
        )
    finally:
        host.sock.close()
    assert rec["status"] == "needs_review", rec
    patch = (root.path / rec["patch_path"]).read_text()
    assert patch.count("+from-dockerfile") == 1 and "+kept.txt" in patch and "+.devcontainer" in patch
    assert "+.env" not in patch and "+.git" not in patch, patch
    assert "+six-" in patch, patch  # the wheel the RUN step fetched through the gateway
    built = rec["environment"]["build_egress"]
    assert {r["host"] for r in built["requests"]} == {"pypi.test"} and built["denied"] == 0, built
    # Raw frames from the same build: no host found, nothing heard.
    assert "+RESULT no host" in patch and not host.got, (patch, host.got)
    # A RUN step that reaches a host the allowlist does not list: refused by the gateway, and said.
    (dc / "Dockerfile").write_text(
        f"FROM {pkgindex.testenv_image}\nRUN npm view uvu --registry {pkgindex.npm_url} --fetch-retries 0\n"
    )
    rec = submit_run(root, "true")
    assert rec["status"] == "failed" and rec["error"]["kind"] == "environment", rec
    assert "its gateway refused npm.test:4873" in rec["error"]["message"], rec["error"]
    # With no allowlist the build has no network at all.
    setup_policy(root, pkgindex, allow=[])
    (dc / "Dockerfile").write_text(f"FROM {pkgindex.testenv_image}\nRUN {fetch}\n")
    rec = submit_run(root, "true")
    assert rec["status"] == "failed" and "have no network" in rec["error"]["message"], rec["error"]
    (dc / "Dockerfile").write_text(f"FROM {pkgindex.testenv_image}\nRUN sleep 60\n")
    setup_policy(root, pkgindex, allow=[], timeout_ms=3000)
    rec = submit_run(root, "true")
    assert rec["status"] == "failed" and "environment.timeout_ms 3000" in rec["error"]["message"], rec


def test_a_dockerfile_run_step_is_held_to_the_setups_pids_and_size(tmp_path: Path, pkgindex: Any) -> None:
    """The builder sets no pids or size limit on a RUN step: fila makes the build's steps children
    of a cgroup of its own holding them to environment.pids, so 20 processes run and 200 cannot
    start (what a fork bomb would hit first), and measures what each step writes while it runs."""
    root = make_root(tmp_path / "pids")
    (root.path / "fila-environment.json").write_text(json.dumps({"build": {"dockerfile": "Dockerfile"}}))
    setup_policy(root, pkgindex, allow=[], pids=64)
    spawn = "RUN n=0; while [ $n -lt {} ]; do sleep 20 & n=$((n+1)); done; kill $(jobs -p); echo ok > /opt/p"
    (root.path / "Dockerfile").write_text(f"FROM {pkgindex.testenv_image}\n{spawn.format(20)}\n")
    rec = submit_run(root, "cat /opt/p > p.txt")
    assert rec["status"] == "needs_review", rec
    assert "+ok" in (root.path / rec["patch_path"]).read_text()
    (root.path / "Dockerfile").write_text(f"FROM {pkgindex.testenv_image}\n{spawn.format(200)}\n")
    rec = submit_run(root, "true")
    assert rec["status"] == "failed" and rec["error"]["kind"] == "environment", rec
    assert "did not build" in rec["error"]["message"], rec["error"]
    assert not list(Path("/sys/fs/cgroup/pids").glob("fila-build-*")), "the build's cgroup is removed"
    # What a step writes is measured while it runs: 10 MB builds; 300 MB (then a long pause) is
    # killed at once, over max_image_bytes, not found only after the build.
    base = _docker("image", "inspect", "-f", "{{.Size}}", pkgindex.testenv_image).strip()
    setup_policy(root, pkgindex, allow=[], max_image_bytes=int(base) + 100_000_000)
    write = "RUN head -c {} /dev/zero > /opt/big; sleep {}"
    (root.path / "Dockerfile").write_text(f"FROM {pkgindex.testenv_image}\n{write.format(10_000_000, 0)}\n")
    assert submit_run(root, "true")["status"] == "needs_review"
    (root.path / "Dockerfile").write_text(f"FROM {pkgindex.testenv_image}\n{write.format(300_000_000, 60)}\n")
    rec = submit_run(root, "true")
    assert rec["status"] == "failed" and "a RUN step made its image" in rec["error"]["message"], rec["error"]


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout


def test_environments_are_built_side_by_side_kept_per_root_and_no_label_names_a_path(
    tmp_path: Path, pkgindex: Any
) -> None:
    """Two roots set up the same key at once: each build fills volumes of its own, the image names
    the ones it was built with, and a task of each root sees the provided directory. The setup
    leaves a broken /bin/sh: the volumes are filled without running the image. gc in a root
    removes only that root's environments, and a key written by a project's Dockerfile never
    names a directory to delete."""
    decl = {"image": pkgindex.testenv_image, "provided": ["node_modules"], "setup": [
        {"name": "mods", "shell": "sleep 2; mkdir -p node_modules/m && echo made > node_modules/m/index.js"},
        {"name": "sh", "shell": "ln -sf /bin/false /bin/sh"}]}  # fmt: skip
    roots = [make_root(tmp_path / name) for name in ("a", "c")]
    for root in roots:
        (root.path / "fila-environment.json").write_text(json.dumps(decl))
        setup_policy(root, pkgindex, allow=[])
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda r: fila_process(r, "env", "build", "--project", str(r.path), "--json",
                                                     timeout=300), roots))  # fmt: skip
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    envs = [json.loads(d.stdout) for d in done]
    key = envs[0]["key"]
    assert envs[1]["key"] == key and {e["how"] for e in envs} <= {"built", "cached"}
    labels = json.loads(
        _docker("image", "inspect", "--format", "{{json .Config.Labels}}", f"fila/env:{key[:32]}")
    )
    assert labels["fila.env.key"] == key and labels["fila.root"] == "" and labels["fila"] == ""
    (volume,) = labels["fila.env.volumes"].split(",")
    assert len(volume.split("-")[-2]) == 16  # the path's hash: 64 bits
    mount = f"{volume}:/v:ro"
    assert _docker("run", "--rm", "-v", mount, "--entrypoint", "cat", pkgindex.testenv_image,
                   "/v/m/index.js") == "made\n"  # fmt: skip
    # A project's Dockerfile labels its base as an environment with a key that is a path: built,
    # never listed, never removed.
    evil = make_root(tmp_path / "b")
    victim = tmp_path / "victim-dir"
    victim.mkdir()
    (evil.path / "Dockerfile").write_text(
        f'FROM {pkgindex.testenv_image}\nLABEL fila.env.key="../../../../victim-dir"\n'
    )
    (evil.path / "fila-environment.json").write_text(json.dumps({"build": {"dockerfile": "Dockerfile"}}))
    setup_policy(evil, pkgindex, allow=[])
    res = fila(evil, "env", "build", "--project", str(evil.path), "--json")
    assert res.exit_code == 0, res.output
    evil_key = json.loads(res.stdout)["key"]
    listed = json.loads(fila(evil, "env", "ls", "--json").stdout)
    assert {key, evil_key} <= {e["key"] for e in listed} and all(len(e["key"]) == 64 for e in listed)
    # gc in b removes b's environment only; in a, a's (shared with c: its state is in both).
    gone = json.loads(fila(evil, "env", "gc", "--json").stdout)["removed"]
    assert gone == [evil_key] and victim.is_dir()
    assert _docker("image", "ls", "-q", f"fila/env:{key[:32]}").strip()
    assert json.loads(fila(roots[0], "env", "gc", "--json").stdout)["removed"] == [key]
    assert not _docker("image", "ls", "-q", f"fila/env:{key[:32]}").strip()


def engine_fix(
    root: Root, idx: Any, ups: Any, engine: str, route: str, prompt: str, check: str
) -> dict[str, Any]:
    """`engine` on the project's environment under a policy routing it to the scripted model server
    (whose script the caller set), with a setup that reaches the local indexes `idx` (None: a
    declaration without setup): its record."""
    from tests.support.engines import E2E_ENGINES, KEY_VAR
    from tests.support.policy import model_policy, model_route

    doc = model_policy(ups, {route: model_route(ups, KEY_VAR)})
    if idx is not None:
        doc["environment"] = {"allow": idx.allow(), "allow_private": [idx.subnet],
                              "egress_network": idx.network, "timeout_ms": 300_000}  # fmt: skip
    write_policy(root, engine, doc)
    res = fila(
        root,
        *("submit", "--engine", engine, "--model", E2E_ENGINES[engine].model, "--policy", engine),
        *("--target", ".", "--prompt", prompt, "--check", check, "--run"),
        env={KEY_VAR: "sk-test-environment-0123456789abcdef"},
    )
    rec = record(root, res.stdout.split()[0])
    rec["_output"] = res.output
    return rec


def _bash(command: str) -> dict[str, Any]:
    return {"protocol": "anthropic", "when": "tool_result", "reply": {"tool": {"name": "Bash", "arguments": {
        "command": command, "description": "run the project's tests"}}}}  # fmt: skip


def claude_fixes_it(root: Root, pkgindex: Any, upstreams: Any) -> None:
    """Claude Code on the Python project's environment, driven by the scripted model server: it runs
    `python -m pytest` in its Bash tool (the project's own Python, from the setup's .venv), reads
    the failure, edits, runs it again; the record's check passes. What the model received back
    from each tool call is in the model server's log: the failure, then the pass."""
    first = _bash("python -m pytest -q")
    first["when"] = "no_tool_result"
    edit = {"file_path": "/job/work/calc.py", "old_string": "a - b", "new_string": "a + b"}
    upstreams.set_script([
        first,
        {"protocol": "anthropic", "when": "tool_result",
         "reply": {"tool": {"name": "Read", "arguments": {"file_path": "/job/work/calc.py"}}}},
        {"protocol": "anthropic", "when": "tool_result", "reply": {"tool": {"name": "Edit", "arguments": edit}}},  # noqa: E501
        _bash("python -m pytest -q"),
        {"protocol": "anthropic", "when": "tool_result", "reply": {"text": "Fixed add(); the test passes."}},
    ])  # fmt: skip
    rec = engine_fix(
        root, pkgindex, upstreams, "claude", "anthropic", "make the failing test pass", "pytest -q"
    )
    assert rec["status"] == "needs_review", (rec.get("error"), rec["_output"][-3000:])
    assert rec["image"]["tag"].startswith("fila/env-claude:"), rec["image"]
    assert rec["check"]["passed"] is True, rec["check"]
    assert rec["diffstat"]["paths"] == ["calc.py"]
    results = [json.dumps(r.get("body", r)) for r in upstreams.requests("model.test")]
    ran = [r for r in results if "tool_result" in r]
    assert any("1 failed" in r for r in ran), ran
    assert any("1 passed" in r for r in ran[-1:]), ran[-1:]


# In aider's layer, its Python imports its heavy modules and reads which shared objects it has
# mapped: its interpreter, loader, libc and every library, all from its prefix (never the
# environment's /lib). (glibc reads the environment's locale data, which is not code.)
AIDER_MAPS = (
    "/opt/aider/bin/python -I -c 'import aider.main, litellm, numpy, PIL.Image, ssl, sqlite3; "
    'maps = {f[5] for f in map(str.split, open("/proc/self/maps")) if len(f) > 5 and ".so" in f[5]}; '
    'print("mapped", len(maps), "outside", sorted(m for m in maps if not m.startswith("/opt/aider/")))\''
)


def only_aiders_libraries(out: str) -> bool:
    """AIDER_MAPS said it mapped its libraries (numpy's, PIL's, ssl's: dozens), none outside."""
    seen = re.search(r"mapped (\d+) outside \[\]", out)
    return seen is not None and int(seen.group(1)) > 20


@pytest.mark.engines
@pytest.mark.matrix  # each engine's layer once more (a minute): scripts/test --all
def test_every_engine_answers_on_a_python_and_node_18_environment_and_the_projects_runtimes_stay(
    tmp_path: Path, pkgindex: Any
) -> None:
    """Each engine's CLI layered on the project's image (Python 3.11 and Node 18: fila/testenv)
    answers `--version`, while `node` and `python3` on PATH stay the project's; aider's Python
    loads nothing from the environment's own libraries, which are there."""
    from fila.engines import get_engine
    from fila.sandbox.docker.backend import DockerBackend

    root = make_root(tmp_path / "p")
    (root.path / "fila-environment.json").write_text(json.dumps({"image": pkgindex.testenv_image}))
    engines = ["claude", "codex", "gemini", "qwen", "opencode", "aider", "shell"]
    res = fila(root, "env", "build", *(a for e in engines for a in ("-e", e)), "--json")
    assert res.exit_code == 0, res.output
    built = json.loads(res.stdout)
    backend = DockerBackend(pkgindex.docker)
    for name in engines:
        image = built["engine_images"][name]["tag"]
        argv = " ".join(get_engine(name).version_argv) if name != "shell" else "sh -c true"
        code, out = backend.smoke_run(
            image, ("/bin/sh", "-c", f"{argv} && node --version && command -v python3")
        )
        assert code == 0, (name, out)
        assert "v18." in out and "/usr/bin/python3" in out, (name, out)
    # An empty libz where LD_LIBRARY_PATH points stops the project's python3; aider loads its own.
    script = " && ".join([
        "ls /lib/x86_64-linux-gnu/libz.so.1", AIDER_MAPS, "mkdir /tmp/p", ": > /tmp/p/libz.so.1",
        "{ LD_LIBRARY_PATH=/tmp/p python3 -c 1; echo project python $?; }",
        "LD_LIBRARY_PATH=/tmp/p aider --version",
    ])  # fmt: skip
    code, out = backend.smoke_run(built["engine_images"]["aider"]["tag"], ("/bin/sh", "-c", script))
    assert code == 0 and only_aiders_libraries(out), out
    assert "libz.so.1: file too short" in out and "project python 127" in out and "aider 0.86.2" in out, out


@pytest.mark.engines
@pytest.mark.matrix  # aider's layer on busybox (half a minute): scripts/test --all
def test_aider_brings_its_own_python_to_an_environment_without_one(
    tmp_path: Path, shell_image: Any, docker_client: Any
) -> None:
    """A project whose environment has no Python and no glibc (busybox: fila/shell): aider's layer
    runs its own Python from its prefix and loads only the prefix's shared objects, and neither
    the project's PYTHONPATH nor its LD_LIBRARY_PATH reach it."""
    from fila.sandbox.docker.backend import DockerBackend
    from tests.support.engines import engine_image

    engine_image(docker_client, "aider")
    root = make_root(tmp_path / "bb")
    (root.path / "fila-environment.json").write_text(json.dumps({"image": shell_image.tag}))
    res = fila(root, "env", "build", "-e", "aider", "--json")
    assert res.exit_code == 0, res.output
    image = json.loads(res.stdout)["engine_images"]["aider"]["tag"]
    # A project's module and library where its variables point: a Python that reads PYTHONPATH
    # imports the project's module (the trap is real); aider, launched as a task launches it,
    # imports its own and loads its own libz.
    shadow = "mkdir /tmp/p && : > /tmp/p/libz.so.1 && "
    shadow += "echo 'raise SystemExit(\"the project shtab\")' > /tmp/p/shtab.py"
    script = " && ".join([
        "! command -v python3", "! test -e /lib/x86_64-linux-gnu", "aider --version", AIDER_MAPS, shadow,
        "{ PYTHONPATH=/tmp/p /opt/aider/bin/python -c 'import shtab'; echo plain python $?; }",
        "PYTHONPATH=/tmp/p LD_LIBRARY_PATH=/tmp/p aider --version",
    ])  # fmt: skip
    code, out = DockerBackend(docker_client).smoke_run(image, ("/bin/sh", "-c", script))
    assert code == 0 and out.count("aider 0.86.2") == 2 and only_aiders_libraries(out), out
    assert "the project shtab\nplain python 1" in out, out


@pytest.mark.engines
@pytest.mark.matrix  # aider's task on an environment once more (a minute): scripts/test --all
def test_aider_fixes_a_file_on_an_environment_without_python_through_the_gateway(
    tmp_path: Path, upstreams: Any, gateway_image: str, shell_image: Any, docker_client: Any
) -> None:
    """aider's task on the busybox environment, driven by the scripted model server: its shell
    steps run on busybox, it edits the file, and the check (busybox's grep) passes."""
    from tests.support.engines import engine_image

    engine_image(docker_client, "aider")
    root = make_root(tmp_path / "bb")
    (root.path / "fila-environment.json").write_text(json.dumps({"image": shell_image.tag}))
    (root.path / "greeting.txt").write_text("helo\n")
    upstreams.set_script([{"protocol": "openai", "reply": {"text": "greeting.txt\n```\nhello\n```\n"}}])
    rec = engine_fix(root, None, upstreams, "aider", "openai", "fix the typo", "grep -qx hello greeting.txt")
    assert rec["status"] == "needs_review", (rec["error"], rec["_output"][-2000:])
    assert rec["image"]["tag"].startswith("fila/env-aider:") and rec["environment"]["how"] == "built"
    assert rec["check"]["passed"] is True, rec["check"]
    assert rec["diffstat"]["paths"] == ["greeting.txt"], rec["diffstat"]


DUR = "const ms = require('ms');\nmodule.exports = (s) => ms(s) + 1;\n"
DUR_FIXED = "const ms = require('ms');\nmodule.exports = (s) => ms(s);\n"
NODE_TEST = (
    "const { test } = require('uvu');\nconst assert = require('uvu/assert');\n"
    "const dur = require('../dur');\n"
    "test('two seconds', () => { assert.is(dur('2s'), 2000); });\ntest.run();\n"
)


@pytest.mark.engines
@pytest.mark.matrix  # the Node-side twin of the claude case (a minute): scripts/test --all
def test_qwen_runs_npm_test_on_a_node_project_fixes_it_and_the_check_passes(
    tmp_path: Path, pkgindex: Any, upstreams: Any, gateway_image: str
) -> None:
    """A Node 18 project whose setup installs its dependencies from npm.test into node_modules
    (provided: mounted read-only, never copied, never diffed), and qwen (a Node CLI on its own
    Node) running the project's `npm test` with the project's node, fixing, running it again."""
    root = make_root(tmp_path / "node")
    package = {"name": "dur", "version": "1.0.0", "private": True, "scripts": {"test": "uvu tests"},
               "dependencies": {"ms": "^2.1.3"}, "devDependencies": {"uvu": "^0.5.6"}}  # fmt: skip
    for rel, text in {"package.json": json.dumps(package), "dur.js": DUR, "tests/dur.js": NODE_TEST}.items():
        (root.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (root.path / rel).write_text(text)
    decl = {
        "image": pkgindex.testenv_image,
        "containerEnv": pkgindex.npm_env,
        "postCreateCommand": "npm install",
    }
    (root.path / ".devcontainer.json").write_text(json.dumps(decl))

    def shell(when: str) -> dict[str, Any]:
        return {"protocol": "openai", "when": when, "reply": {"tool": {"name": "run_shell_command",
                "arguments": {"command": "npm test", "description": "run the tests"}}}}  # fmt: skip

    write = {"file_path": "/job/work/dur.js", "content": DUR_FIXED}
    upstreams.set_script([
        shell("no_tool_result"),
        {"protocol": "openai", "when": "tool_result",
         "reply": {"tool": {"name": "read_file", "arguments": {"file_path": "/job/work/dur.js"}}}},
        {"protocol": "openai", "when": "tool_result", "reply": {"tool": {"name": "write_file", "arguments": write}}},  # noqa: E501
        shell("tool_result"),
        {"protocol": "openai", "when": "tool_result", "reply": {"text": "Fixed dur.js."}},
    ])  # fmt: skip
    rec = engine_fix(root, pkgindex, upstreams, "qwen", "openai", "make npm test pass", "npm test")
    assert rec["status"] == "needs_review", rec
    env = rec["environment"]
    assert env["provided"] == ["node_modules"] and rec["image"]["tag"].startswith("fila/env-qwen:")
    assert rec["check"]["passed"] is True, rec["check"]
    assert rec["diffstat"]["paths"] == ["dur.js"], rec["diffstat"]
    ran = [json.dumps(r.get("body", r)) for r in upstreams.requests("model.test")]
    assert any("FAIL" in r or "Expected" in r for r in ran), ran


def test_a_postgresql_runner_builds_the_environment_on_its_host_and_the_record_names_it(
    tmp_path: Path, pkgindex: Any, pg_url: str, q: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The declaration travels with the task's targets; the runner host sets the environment up
    under its own policy (its `environment` section), runs the engine and the check in it, and
    publishes a record that names the environment's key."""
    from tests.support.pg_runner import fila as fila_any

    sub = make_root(tmp_path / "sub")
    (sub.path / "a.txt").write_text("a\n")
    setup = [{"name": "mark", "shell": "echo from-setup > /opt/marker"}]
    (sub.path / "fila-environment.json").write_text(
        json.dumps({"image": pkgindex.testenv_image, "setup": setup})
    )
    runner = make_root(tmp_path / "runner")
    setup_policy(runner, pkgindex, allow=[])
    res = fila_any("submit", "--queue", pg_url, "--root", str(sub.path), "--id", "envpg", "--engine", "shell",
                   "--command", "cat /opt/marker >> a.txt", "-t", "a.txt", "-t", "fila-environment.json",
                   "--check", "grep -q from-setup a.txt")  # fmt: skip
    assert res.exit_code == 0, res.output
    monkeypatch.delenv("FILA_BACKEND", raising=False)
    res = fila_any("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "e1", "--once",
                   "--engine", "shell")  # fmt: skip
    assert res.exit_code == 0, res.output
    rec = q.get("envpg")
    assert rec.status == "needs_review" and rec.check is not None and rec.check.passed, rec
    assert rec.environment is not None and rec.environment.how == "built" and len(rec.environment.key) == 64
    # The submitter pinned what the environment is made of (its policy is not the runner's: the
    # key's network part is the runner's own); the runner made the same.
    assert rec.task.environment_digest is not None and rec.environment.pinned == rec.environment.digest
    assert rec.environment.digest == rec.task.environment_digest
    assert b"+from-setup" in q.blob(q.task_blobs("envpg")["DIFF.patch"])
    # A runner whose base image is another image under the same name (built separately on its
    # host) refuses a task pinned to the submitter's: no setup, no engine, both digests said.
    base = f"fila/pinned-base-{secrets.token_hex(4)}:latest"
    _docker("tag", pkgindex.testenv_image, base)
    try:
        (sub.path / "fila-environment.json").write_text(json.dumps({"image": base, "setup": setup}))
        res = fila_any("submit", "--queue", pg_url, "--root", str(sub.path), "--id", "envpg2",
                       "--engine", "shell", "--command", "true",
                       "-t", "a.txt", "-t", "fila-environment.json")  # fmt: skip
        assert res.exit_code == 0, res.output
        _docker("tag", "fila/base-busybox:local", base)
        res = fila_any("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "e1", "--once",
                       "--engine", "shell")  # fmt: skip
        other = q.get("envpg2")
        assert other.status == "failed" and other.error and other.error.kind == "environment", other
        assert "submitted for an environment made of" in other.error.message, other.error
        assert other.environment is not None and other.environment.pinned == other.task.environment_digest
        assert other.environment.digest != other.environment.pinned and not other.container_started
    finally:
        _docker("rmi", base)


PRIVATE_USER, PRIVATE_PASSWORD = "corp", "corp-index-password-5f0c9e2a71"
# The setup reads the private index's page for six through the route and installs the wheel it
# links to, under the route too: pypiserver links from its root (`/packages/...`), which a route
# serves under its own path (docs/environments.md, "Secrets for the setup").
WHEEL_HREF = (
    "import os, re, urllib.request as u\n"
    'page = u.urlopen(os.environ["FILA_ROUTE_CORP"] + "/simple/six/").read().decode()\n'
    'print(re.search(r\'href="([^"]+[.]whl[^"]*)"\', page)[1])'
)
PRIVATE_SETUP = (
    'echo "$FILA_ROUTE_CORP" > /opt/route-url.txt; env; '
    # Through the route: the gateway adds the token the setup never holds.
    f"href=$(python3 -c {shlex.quote(WHEEL_HREF)}) && python3 -m venv /opt/v && /opt/v/bin/pip install -q "
    '--trusted-host "$(echo "$FILA_ROUTE_CORP" | cut -d/ -f3)" "$FILA_ROUTE_CORP$href" || exit 9; '
    # Straight to the private host through the proxy: not listed, refused by the gateway.
    "if python3 -c 'import urllib.request as u; u.urlopen(\"http://private.test:8080/simple/six/\")'"
    "; then echo DIRECT-ALLOWED; else echo DIRECT-REFUSED; fi"
)
# The engine's job: its env, and the setup's route asked of its own gateway (which has none).
PROBE = """import os, urllib.request as u, urllib.error as e
gw = os.environ["HTTP_PROXY"].rsplit(":", 1)[0]
try: print("corp-route:", u.urlopen(gw + ":8080/corp/simple/six/").status)
except e.HTTPError as x: print("corp-route:", x.code)
import six; print("six", six.__version__)
"""
ENGINE_PROBE = f"env; echo route-var=[$FILA_ROUTE_CORP]; /opt/v/bin/python -c '{PROBE}'"


def _private_policy(root: Root, idx: Any) -> None:
    """The engine under network allowlist (its own gateway: pypi.test only); the setup reaching
    only the route `corp` to private.test, the credential from CORP_TOKEN as HTTP Basic."""
    doc = json.loads((root.path / "policies" / "default.json").read_text())
    near = {"allow_private": [idx.subnet], "egress_network": idx.network}
    doc |= {"network": "allowlist", "egress": {"allow": [{"host": "pypi.test", "port": 8080}], **near}}
    corp = {"upstream": "http://private.test:8080", "credential": "CORP_TOKEN", "format": "Basic {key}"}
    doc["environment"] = {"allow": [], **near, "timeout_ms": 300_000, "routes": {"corp": corp}}
    write_policy(root, "default", doc)


def test_a_setup_route_reaches_a_private_index_and_its_token_reaches_nothing_else(
    tmp_path: Path, pkgindex: Any, gateway_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/environments.md, "Secrets for the setup". A private index (private.test) answers one
    user; the policy's setup route `corp` holds the credential. Without the credential the task
    fails before any setup container; with it, the setup installs through the route while the
    same host asked straight through the proxy is refused; the token is in neither the setup's
    environment, its log, the committed image (history, config, files) nor any record; the
    engine's job has no route, no URL, no token; a rotated token reuses the environment."""
    import base64

    from tests.support.pkgindex import private_pypi

    token = base64.b64encode(f"{PRIVATE_USER}:{PRIVATE_PASSWORD}".encode()).decode()
    root = make_root(tmp_path / "priv")
    decl = {"image": pkgindex.testenv_image, "setup": [{"name": "private", "shell": PRIVATE_SETUP}]}
    (root.path / "fila-environment.json").write_text(json.dumps(decl))
    _private_policy(root, pkgindex)
    monkeypatch.delenv("CORP_TOKEN", raising=False)
    with private_pypi(pkgindex, PRIVATE_USER, PRIVATE_PASSWORD) as private:
        index = pkgindex.docker.containers.get(private.container)
        # Without the credential: failed with kind environment, naming the route and the variable,
        # before any setup container (no setup log, nothing asked of the index).
        missing = submit_run(root, ENGINE_PROBE)
        assert missing["status"] == "failed" and missing["error"]["kind"] == "environment", missing
        said = missing["error"]["message"]
        assert "environment.routes.corp.credential" in said and "CORP_TOKEN is not set" in said, said
        assert not missing["container_started"] and not list(root.path.glob("sandbox/envs/*/setup.log"))
        assert "/simple/six/" not in index.logs().decode()
        # With it: built through the route; the same host asked directly is refused.
        monkeypatch.setenv("CORP_TOKEN", token)
        built = submit_run(root, ENGINE_PROBE)
        assert built["status"] == "needs_review", (built["error"], built.get("environment"))
        env = built["environment"]
        setup_log = (root.path / env["log_path"]).read_text()
        assert env["how"] == "built" and "FILA_ROUTE_CORP=http://" in setup_log, setup_log
        assert "DIRECT-REFUSED" in setup_log and "DIRECT-ALLOWED" not in setup_log, setup_log
        assert '"GET /simple/six/ HTTP/1.1" 200' in index.logs().decode()
        reqs = [
            (r["door"], r["host"], r.get("route"), r["path"], r["allowed"]) for r in env["egress"]["requests"]
        ]
        assert ("route", "private.test", "corp", "/simple/six/", True) in reqs, reqs
        assert any(d == "route" and p.startswith("/packages/six-") and ok for d, _h, _r, p, ok in reqs), reqs
        assert any(d == "proxy" and h == "private.test" and not ok for d, h, _r, _p, ok in reqs), reqs
        # The engine's job: the setup's six is there; its route, URL and token are not.
        log = (root.path / built["log_path"]).read_text()
        assert "six 1." in log and "corp-route: 404" in log and "route-var=[]" in log, log
        # A rotated token reuses the environment: the key names no credential.
        monkeypatch.setenv("CORP_TOKEN", base64.b64encode(b"corp:rotated-password-0123").decode())
        rotated = submit_run(root, "true")
        assert rotated["environment"]["how"] == "cached" and rotated["environment"]["key"] == env["key"]
        # Without allow_private for its address, the route is refused as the proxy door refuses
        # the same host: nothing is asked of the index, the token is sent nowhere.
        doc = json.loads((root.path / "policies" / "default.json").read_text())
        del doc["environment"]["allow_private"]
        write_policy(root, "default", doc)
        asked = index.logs().decode().count("/simple/six/")
        closed = submit_run(root, "true")
        assert closed["status"] == "failed" and closed["error"]["kind"] == "environment", closed
        refused = [
            (r["path"], r["allowed"], r["status"], r["reason"])
            for r in closed["environment"]["egress"]["requests"]
            if r["door"] == "route"
        ]
        assert refused and not any(ok for _p, ok, _s, _r in refused), refused
        assert all("private address" in (why or "") for _p, _ok, _s, why in refused), refused
        assert index.logs().decode().count("/simple/six/") == asked
    # The token (and the password in it) is nowhere fila wrote, nor in the image.
    secrets_ = [token.encode(), PRIVATE_PASSWORD.encode()]
    for text in (*(json.dumps(r) for r in (missing, built, rotated, closed)), setup_log, log):
        assert "***" not in text and not any(s.decode() in text for s in secrets_)
    tag = env["image"]["tag"]
    config = json.loads(_docker("image", "inspect", tag))[0]["Config"]
    assert "FILA_ROUTE_CORP=" in config["Env"] and "HTTP_PROXY=" in config["Env"], config["Env"]
    assert not any(s.decode() in _docker("history", "--no-trunc", tag) + json.dumps(config) for s in secrets_)
    cid = _docker("create", tag).strip()
    try:
        export = subprocess.run(["docker", "export", cid], capture_output=True, check=True).stdout
    finally:
        _docker("rm", cid)
    # What the setup wrote is in the export (the grep sees the setup's files); the token is not.
    assert b":8080/corp\n" in export and not any(s in export for s in secrets_)


def _labelled(root: Root, role: str) -> list[str]:
    flt = ["--filter", f"label=fila.root={root.path}", "--filter", f"label=fila.role={role}"]
    return subprocess.run(
        ["docker", "ps", "-aq", *flt], capture_output=True, text=True, check=True
    ).stdout.split()


def _wait_for(what: Any, timeout: float = 120) -> Any:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := what():
            return got
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_a_recovery_pass_beside_fila_env_build_keeps_its_gateway_and_removes_a_killed_builds_token(
    tmp_path: Path, pkgindex: Any, gateway_image: str
) -> None:
    """`fila env build` runs no task: its hold (docs/environments.md, "Commands") is what a
    recovery pass beside it (a worker runs one each round) sees alive, so its build gateway stays
    and the build ends well; killed mid-build, the gateway's directory (the route's token) and its
    containers are removed by the next `fila recover`."""
    import os

    from tests.support.cli import CLI

    root = make_root(tmp_path / "sweep")
    # Long enough for the recovery pass to run beside it (a few seconds; its gateway is asserted
    # kept after the pass, so a build that ended first fails the test, never passes it).
    (root.path / "Dockerfile").write_text(f"FROM {pkgindex.testenv_image}\nRUN sleep 12\n")
    (root.path / "fila-environment.json").write_text(json.dumps({"build": {"dockerfile": "Dockerfile"}}))
    doc = json.loads((root.path / "policies" / "default.json").read_text())
    near = {"allow_private": [pkgindex.subnet], "egress_network": pkgindex.network}
    corp = {"upstream": "http://private.test:8080", "credential": "CORP_TOKEN"}
    doc["environment"] = {"allow": [], **near, "timeout_ms": 300_000, "routes": {"corp": corp}}
    write_policy(root, "default", doc)
    token = "fix2-route-token-8c41"
    env = {**os.environ, "FILA_ROOT": str(root.path), "CORP_TOKEN": token}
    held = "sandbox/envs/held/*/gateway/secrets/corp"
    build = subprocess.Popen([*CLI, "env", "build"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        _wait_for(lambda: _labelled(root, "gateway"))
        secret = _wait_for(lambda: list(root.path.glob(held)))[0]
        rep = fila_process(root, "recover", check=True)
        assert _labelled(root, "gateway") and secret.read_text() == token, rep.stdout  # kept: alive
        out, _ = build.communicate(timeout=240)
    finally:
        build.kill()
    assert build.returncode == 0, out  # the build kept its gateway and network to the end
    assert not secret.exists()
    # Killed mid-build (another base to build): what it held is left on disk, free, and the next
    # recovery takes it.
    (root.path / "Dockerfile").write_text(f"FROM {pkgindex.testenv_image}\nRUN sleep 60\n")
    build = subprocess.Popen([*CLI, "env", "build"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        secret = _wait_for(lambda: list(root.path.glob(held)))[0]
        _wait_for(lambda: _labelled(root, "gateway"))
    finally:
        build.kill()
        build.wait()
    assert secret.read_text() == token
    fila_process(root, "recover")
    assert not secret.exists() and list(root.path.glob("sandbox/envs/held/*")) == []
    assert _labelled(root, "gateway") == []

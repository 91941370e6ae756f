"""`network: allowlist` end to end on real Docker: the job's gateway, its network, its record.

The engine is the shell engine on fila/testnet (curl); the upstreams are the test servers of
tests/upstreams (model.test, allowed.test, denied.test) on their own sealed `--internal` network,
which the policy names as its egress network. Every blocked request is shown next to the allowed
one succeeding in the same job.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import docker
import pytest
import requests

from fila.core.models import ImageRef
from fila.egress import config as egress
from fila.sandbox.docker import egress as docker_egress
from fila.sandbox.docker.backend import DockerBackend
from fila.workspace.strategy import CopyWorkspace
from tests.support.cli import FILA_SCRIPT, fila, run_once_console
from tests.support.containers import held_elsewhere, reaped, reapers
from tests.support.project import make_project, make_root, record
from tests.upstreams import Upstreams
from tests.upstreams.fixtures import create_on_free_subnet

pytestmark = pytest.mark.docker

KEY_VAR = "FILA_TEST_ANTHROPIC_KEY"
MESSAGES = (
    '-H "content-type: application/json" -H "anthropic-version: 2023-06-01" '
    '-d \'{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}\''
)


@pytest.fixture(scope="module")
def images(docker_client: docker.DockerClient, gateway_image: str) -> ImageRef:
    from fila.sandbox.images import ensure_image

    return ensure_image("testnet", DockerBackend(docker_client), progress=lambda _l: None)


@pytest.fixture
def proj(tmp_path: Path, upstreams: Upstreams, images: ImageRef) -> Path:
    make_project(tmp_path)
    # The engine trusts the test CA (its TLS goes through the gateway's tunnel untouched).
    shutil.copyfile(upstreams.ca_file, tmp_path / "ca.crt")
    return tmp_path


def write_policy(root: Path, name: str, **kw: Any) -> None:
    base: dict[str, Any] = {
        "network": "allowlist",
        "max_timeout_ms": 120_000,
        "default_timeout_ms": 60_000,
        "grace_ms": 1000,
        "memory": "512m",
    }
    (root / "policies" / f"{name}.json").write_text(json.dumps(base | kw))


def egress_for(ups: Upstreams, **kw: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"allow": [{"host": "allowed.test", "port": 443}], "egress_network": ups.network}
    return e | kw


def anthropic_route(ups: Upstreams) -> dict[str, Any]:
    return {
        "anthropic": {"upstream": "https://model.test", "credential": KEY_VAR, "ca_file": str(ups.ca_file)}
    }


def submit_task(root: Path, policy: str, command: str, env: dict[str, str] | None = None) -> str:
    task = {
        "engine": "shell",
        "command": command,
        "targets": ["greeting.txt", "ca.crt"],
        "policy": policy,
        "image": "fila/testnet:latest",
    }
    (root / "task.json").write_text(json.dumps(task))
    res = fila(root, "submit", str(root / "task.json"), env=env)
    assert res.exit_code == 0, res.output
    return res.stdout.strip()


def run_once(root: Path, env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return run_once_console(root, env, timeout=180, **kw)


def leftovers(client: docker.DockerClient, root: Path, tid: str) -> list[str]:
    """Everything of the job that must be gone: containers (engine and gateway), its network,
    the gateway's directory with the secrets; a spare gateway the job took (or the worker kept)
    is found by its spare label, its directory and lock under sandbox/spares (once the reaper a
    one-shot process leaves is done)."""
    reaped(root / "sandbox" / "spares")
    out = []
    for f in ({"label": [f"fila.job={tid}"]}, {"label": ["fila.spare", f"fila.root={root}"]}):
        out += [f"container {c.name}" for c in client.containers.list(all=True, filters=f)]
        out += [f"network {n.name}" for n in client.networks.list(filters=f)]
    spares = root / "sandbox" / "spares"
    if (root / "sandbox" / "meta" / tid / "egress").exists() or (spares.is_dir() and any(spares.iterdir())):
        out.append("the gateway directory")
    return out


class Inspector(threading.Thread):
    """Captures `docker inspect` of the job's engine and gateway containers while they run."""

    def __init__(self, client: docker.DockerClient, root: Path) -> None:
        super().__init__(daemon=True)
        self.client, self.root = client, root
        self.seen: dict[str, dict[str, Any]] = {}
        self.networks: dict[str, dict[str, Any]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            # A container or network removed between the listing and its inspection (the job's
            # end, a one-shot's reaper) is looked for again on the next turn.
            with contextlib.suppress(docker.errors.NotFound):
                for c in self.client.containers.list(filters={"label": f"fila.root={self.root}"}):
                    self.seen.setdefault(c.labels.get("fila.role", "engine"), c.attrs)
                for n in self.client.networks.list(
                    filters={"label": [f"fila.root={self.root}", "fila.role=job-net"]}
                ):
                    self.networks.setdefault(n.name, n.attrs)
            time.sleep(0.1)


# -- the allowlist, the routes and the secret --------------------------------------------------


@pytest.mark.quick
def test_engine_reaches_the_listed_host_and_the_model_route_never_an_unlisted_host_nor_the_key(
    proj: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
) -> None:
    secret = f"sk-test-{secrets.token_hex(16)}"
    env = {KEY_VAR: secret}
    write_policy(
        proj,
        "allow",
        egress=egress_for(upstreams, routes=anthropic_route(upstreams), allow_private=[upstreams.subnet]),
    )
    allowed_ip = upstreams.ip("allowed.test")
    cmd = (
        'echo "allowed: $(curl -sS --max-time 10 --cacert ca.crt https://allowed.test/ 2>&1)"; '
        'echo "denied: $(curl -sS --max-time 10 --cacert ca.crt -o /dev/null -w "%{http_connect}" '
        'https://denied.test/ 2>/dev/null)"; '
        'echo "direct: $(curl -sS --noproxy "*" --connect-timeout 3 --max-time 5 -k '
        f'https://{allowed_ip}/ 2>&1)"; '
        'echo "dns: $(getent hosts allowed.test || echo none)"; '
        'echo "ipv6 off: $(cat /proc/sys/net/ipv6/conf/all/disable_ipv6)"; '
        f'echo "model: $(curl -sS --max-time 10 -X POST "$ANTHROPIC_BASE_URL/v1/messages" '
        f'-H "x-api-key: $ANTHROPIC_API_KEY" {MESSAGES})"; '
        "env | sort > env.txt; sleep 1"
    )
    tid = submit_task(proj, "allow", cmd, env=env)
    upstreams.set_script(
        [{"reply": {"text": "hello from the model"}, "usage": {"input_tokens": 7, "output_tokens": 3}}]
    )
    upstreams.clear_requests()
    watch = Inspector(docker_client, proj)
    watch.start()
    try:
        res = run_once(proj, env)
    finally:
        watch.stop.set()
        watch.join()
    assert res.returncode == 0, res.stderr
    rec = record(proj, tid)
    assert rec["status"] == "needs_review", rec["error"]
    log = (proj / rec["log_path"]).read_text()
    lines = dict(line.split(": ", 1) for line in log.splitlines() if ": " in line)
    # Allowed first: the listed host answers through the gateway's tunnel, TLS end to end.
    assert lines["allowed"] == "hello from allowed.test", log
    # The unlisted host on the same server: the gateway refuses the CONNECT.
    assert lines["denied"] == "403", log
    assert [r["path"] for r in upstreams.requests("denied.test")] == []
    # Around the gateway: no route to the very server that answered through it, no resolver.
    assert "hello from" not in lines["direct"], log
    assert lines["dns"] == "none", log
    assert lines["ipv6 off"] == "1", log  # no IPv6 at all, so no link-local path to the host's bridge
    # The model route: the model server answered, and it DID receive the real key...
    assert "hello from the model" in lines["model"], log
    got = upstreams.requests("model.test")
    assert len(got) == 1 and got[0]["headers"].get("x-api-key") == secret, got
    # ...which the engine never held: its inspect, environment, files, log, the record, REVIEW.html.
    engine = watch.seen["engine"]
    mode = engine["HostConfig"]["NetworkMode"]
    if mode.startswith("container:"):  # the namespace of a spare gateway's holder, on the job network
        holder = watch.seen["netns"]
        assert mode == f"container:{holder['Id']}", (mode, holder["Id"])
        nets = list(holder["NetworkSettings"]["Networks"])
    else:
        nets = list(engine["NetworkSettings"]["Networks"])
        assert nets == [mode], (nets, mode)
    assert len(nets) == 1 and nets[0].startswith("fila-net-"), nets
    assert "ANTHROPIC_API_KEY=fila-placeholder" in engine["Config"]["Env"]
    # The engine's work/: the job's own copy, or the upper layer of its overlay on a snapshot.
    works = [proj / "sandbox" / "jobs" / tid / "work", proj / "sandbox" / "meta" / tid / "overlay" / "upper"]
    env_txt = next(w / "env.txt" for w in works if (w / "env.txt").is_file()).read_text()
    assert "ANTHROPIC_BASE_URL=http://" in env_txt and "HTTPS_PROXY=http://" in env_txt
    html = fila(proj, "review", tid, "--html")
    assert html.exit_code == 0, html.output
    show = fila(proj, "show", tid)
    everything = {
        "engine inspect": json.dumps(engine),
        "engine env": env_txt,
        "job dir": "".join(
            p.read_text(errors="replace")
            for d in (proj / "sandbox" / "jobs" / tid, proj / "sandbox" / "meta" / tid)
            for p in d.rglob("*")
            if p.is_file()
        ),
        "log": log,
        "record": (proj / "fila" / "out" / f"{tid}.json").read_text(),
        "REVIEW.html": Path(html.stdout.strip()).read_text(),
        "show": show.stdout,
    }
    assert [k for k, v in everything.items() if secret in v] == []
    assert "<h2>Egress</h2>" in everything["REVIEW.html"] and "denied.test" in everything["REVIEW.html"]
    # The gateway held it in a file, not in its environment either.
    assert secret not in json.dumps(watch.seen["gateway"])
    # Not a router; and the DNS door binds 53 as the gateway's non-root user.
    sysctls = {"net.ipv4.ip_forward": "0", "net.ipv4.ip_unprivileged_port_start": "53"}
    assert watch.seen["gateway"]["HostConfig"]["Sysctls"] == sysctls
    # The job network: internal, no IPv4 on the bridge, labelled.
    (net,) = watch.networks.values()
    assert net["Internal"] is True and net["EnableIPv6"] is False
    assert net["Options"]["com.docker.network.bridge.inhibit_ipv4"] == "true"
    # The record's egress section: each decision, per-route usage read at the gateway.
    eg = rec["egress"]
    assert eg["allowed"] >= 2 and eg["denied"] >= 1, eg
    denied = [r for r in eg["requests"] if not r["allowed"]]
    assert any(r["host"] == "denied.test" and r["reason"] for r in denied), denied
    assert eg["routes"]["anthropic"]["requests"] == 1
    assert (eg["routes"]["anthropic"]["input_tokens"], eg["routes"]["anthropic"]["output_tokens"]) == (7, 3)
    assert "route     anthropic: 1 requests" in show.stdout and "DENIED" in show.stdout
    text = fila(proj, "review", tid, "--no-pager")
    assert "route     anthropic: 1 requests" in text.stdout and "denied.test:443" in text.stdout, text.output
    rv = fila(proj, "review", tid, "--json")
    assert json.loads(rv.stdout)["egress"]["denied"] == eg["denied"]
    # Nothing of the job is left: no gateway, no network, no secrets directory.
    assert leftovers(docker_client, proj, tid) == []


def test_a_listed_host_on_a_private_address_is_refused_unless_allow_private_covers_it(
    proj: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
) -> None:
    cmd = 'echo "allowed: $(curl -sS --max-time 10 --cacert ca.crt https://allowed.test/ 2>&1)"'
    write_policy(proj, "private-ok", egress=egress_for(upstreams, allow_private=[upstreams.subnet]))
    write_policy(proj, "private-no", egress=egress_for(upstreams))
    ok = submit_task(proj, "private-ok", cmd)
    no = submit_task(proj, "private-no", cmd)
    res = run_once(proj, {})
    assert res.returncode == 0, res.stderr
    assert "allowed: hello from allowed.test" in (proj / record(proj, ok)["log_path"]).read_text()
    rec = record(proj, no)
    assert "hello from" not in (proj / rec["log_path"]).read_text()
    (req,) = [r for r in rec["egress"]["requests"] if r["host"] == "allowed.test"]
    assert not req["allowed"] and "private" in req["reason"], req
    assert leftovers(docker_client, proj, ok) == leftovers(docker_client, proj, no) == []


def test_the_engine_lookups_reach_only_the_gateway_which_refuses_and_records_them(
    proj: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
) -> None:
    # The allowed counterpart first: the same job reaches allowed.test through the proxy (the
    # gateway resolves for it); then the engine's own lookup of a name carrying data goes only to
    # the gateway's DNS door, is answered REFUSED and shows in the record.
    cmd = (
        'echo "allowed: $(curl -sS --max-time 10 --cacert ca.crt https://allowed.test/ 2>&1)"; '
        'echo "lookup: $(getent hosts secret-data.denied.test || echo failed)"'
    )
    write_policy(proj, "dns", egress=egress_for(upstreams, allow_private=[upstreams.subnet]))
    tid = submit_task(proj, "dns", cmd)
    res = run_once(proj, {})
    assert res.returncode == 0, res.stderr
    log = (proj / record(proj, tid)["log_path"]).read_text()
    assert "allowed: hello from allowed.test" in log and "lookup: failed" in log, log
    reqs = record(proj, tid)["egress"]["requests"]
    dns = [r for r in reqs if r["door"] == "dns"]
    assert dns and all(not r["allowed"] for r in dns), reqs
    assert any("secret-data.denied.test" in (r["host"] or "") for r in dns), dns
    assert leftovers(docker_client, proj, tid) == []


def test_a_budget_ends_the_run_with_429_and_the_record_says_which(
    proj: Path,
    upstreams: Upstreams,
) -> None:
    env = {KEY_VAR: f"sk-test-{secrets.token_hex(8)}"}
    write_policy(
        proj,
        "budget",
        egress=egress_for(
            upstreams, routes=anthropic_route(upstreams), allow_private=[upstreams.subnet], max_requests=1
        ),
    )
    call = (
        'curl -sS --max-time 10 -o /dev/null -w "%{http_code}" -X POST '
        f'"$ANTHROPIC_BASE_URL/v1/messages" {MESSAGES}'
    )
    cmd = f'a=$({call}); b=$({call}); echo "first: $a"; echo "second: $b"; [ "$b" != 429 ]'
    tid = submit_task(proj, "budget", cmd, env=env)
    upstreams.set_script([{"reply": {"text": "one"}}, {"reply": {"text": "two"}}])
    upstreams.clear_requests()
    run_once(proj, env)
    rec = record(proj, tid)
    log = (proj / rec["log_path"]).read_text()
    assert "first: 200" in log and "second: 429" in log, log
    assert len(upstreams.requests("model.test")) == 1  # the second never left the gateway
    assert rec["egress"]["budget_exhausted"] == "max_requests"
    assert rec["status"] == "failed" and "egress budget max_requests ended the run" in rec["error"]["message"]
    assert any("max_requests" in w for w in rec["warnings"])
    assert "budget    max_requests exhausted" in fila(proj, "show", tid).stdout


# -- bad policies: exit 2 naming the field, before any container ---------------------------------


@pytest.mark.parametrize(
    ("egress_doc", "field"),
    [
        ({"routes": {"anthropc": {"credential": KEY_VAR}}}, "egress.routes.anthropc"),
        ({"allow": [{"host": "10.0.0.5"}]}, "egress.allow.0.host"),
        ({"allow": [{"host": "2130706433"}]}, "egress.allow.0.host"),
        ({"allow": [{"host": "metadata.google.internal"}]}, "egress.allow.0.host"),
        ({"allow": [{"host": "localhost"}]}, "egress.allow.0.host"),
        ({"allow": [{"host": "printer.local"}]}, "egress.allow.0.host"),
        (
            {"routes": {"anthropic": {"credential": "FILA_TEST_UNSET_VAR"}}},
            "egress.routes.anthropic.credential",
        ),
        ({}, "egress"),
        ({"allow": [], "routes": {}}, "egress"),
        # A method limit on a CONNECT-only port: the gateway sees no method inside a tunnel.
        ({"allow": [{"host": "registry.npmjs.org", "methods": ["GET"]}]}, "egress.allow.0.methods"),
        (
            {"routes": {"anthropic": {"credential": KEY_VAR, "paths": ["POST /v1/../files"]}}},
            "egress.routes.anthropic.paths.0",
        ),
        (
            {"routes": {"anthropic": {"credential": KEY_VAR, "paths": ["POST /v1/%2e%2e/files"]}}},
            "egress.routes.anthropic.paths.0",
        ),
    ],
)
def test_a_bad_egress_policy_is_refused_naming_the_field(
    tmp_path: Path, egress_doc: dict[str, Any], field: str
) -> None:
    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    write_policy(tmp_path, "good", egress={"allow": [{"host": "registry.npmjs.org"}]})
    write_policy(tmp_path, "bad", egress=egress_doc)
    env = {KEY_VAR: "k"}
    ok = fila(
        tmp_path,
        "submit",
        "--engine",
        "shell",
        "--command",
        "true",
        "--target",
        "greeting.txt",
        "--policy",
        "good",
        env=env,
    )
    assert ok.exit_code == 0, ok.output
    res = fila(
        tmp_path,
        "submit",
        "--engine",
        "shell",
        "--command",
        "true",
        "--target",
        "greeting.txt",
        "--policy",
        "bad",
        env=env,
    )
    assert res.exit_code == 2, res.output
    assert f"'{field}'" in res.output, res.output


def test_egress_without_network_allowlist_is_refused(tmp_path: Path) -> None:
    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    write_policy(tmp_path, "none-egress", network="none", egress={"allow": [{"host": "example.com"}]})
    res = fila(
        tmp_path,
        "submit",
        "--engine",
        "shell",
        "--command",
        "true",
        "--target",
        "greeting.txt",
        "--policy",
        "none-egress",
    )
    assert res.exit_code == 2 and "'egress'" in res.output and "network is 'none'" in res.output, res.output


def test_a_secrets_file_must_be_a_private_regular_file_of_fila_user(tmp_path: Path) -> None:
    make_root(tmp_path)
    (tmp_path / "greeting.txt").write_text("hello\n")
    key = tmp_path / "anthropic.key"
    key.write_text("sk-file\n")
    key.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(key)

    def submit_with(path: Path) -> Any:
        route = {"anthropic": {"credential_file": str(path)}}
        write_policy(tmp_path, "filekey", egress={"routes": route})
        return fila(
            tmp_path,
            "submit",
            "--engine",
            "shell",
            "--command",
            "true",
            "--target",
            "greeting.txt",
            "--policy",
            "filekey",
        )

    assert submit_with(key).exit_code == 0  # the allowed counterpart: 0600, a regular file, ours
    key.chmod(0o640)
    res = submit_with(key)
    assert res.exit_code == 2 and "'egress.routes.anthropic.credential_file'" in res.output, res.output
    assert "chmod 600" in res.output
    key.chmod(0o600)
    res = submit_with(link)
    assert res.exit_code == 2 and "not a regular file" in res.output, res.output
    if os.getuid() == 0:
        os.chown(key, 12345, 12345)
        res = submit_with(key)
        assert res.exit_code == 2 and "owned by uid 12345" in res.output, res.output


# -- crash and recovery ------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["after_checkpoint", "after_container_start"])
def test_a_killed_run_leaves_gateway_and_network_that_recover_removes(
    proj: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    point: str,
) -> None:
    write_policy(proj, "crash", egress=egress_for(upstreams, allow_private=[upstreams.subnet]))
    tid = submit_task(proj, "crash", "sleep 30")
    res = run_once(proj, {"FILA_CRASH_AT": point})
    assert res.returncode == -9, (res.returncode, res.stderr)
    left = leftovers(docker_client, proj, tid)
    # What the crash left: the engine, the gateway, the job network and the secrets directory. The
    # gateway is the spare `run --once` started beside its claim, with the holder of the engine's
    # network namespace, or, when that spare was not ready in time (a loaded machine), one made
    # for the job, which has no holder.
    assert any(x.startswith("network fila-net-") for x in left) and "the gateway directory" in left, left
    holder = any(x.endswith("-netns") for x in left)
    assert sum(x.startswith("container ") for x in left) == (3 if holder else 2), left
    assert any(x.startswith("container fila-gw-") for x in left), left
    rec = fila(proj, "recover")  # the worker is dead: its lock is free, no TTL to wait out
    assert rec.exit_code == 0, rec.output
    assert leftovers(docker_client, proj, tid) == []
    assert record(proj, tid)["status"] in ("needs_human", "queued")


def untaken_spare(root: Path) -> bool:
    """Whether a spare gateway of `root` listens and no job took it yet (no config written)."""
    d = root / "sandbox" / "spares"
    return d.is_dir() and any(
        (s / "log" / "listening").exists() and not (s / "conf" / "config.json").exists()
        for s in d.iterdir()
        if s.is_dir()
    )


def test_a_worker_keeps_a_spare_gateway_and_a_killed_one_leaves_nothing_after_recover(
    proj: Path, upstreams: Upstreams, docker_client: docker.DockerClient
) -> None:
    """A long-running worker makes the next spare once a job took one; stopped, it removes it
    itself; SIGKILLed with a spare up, `fila recover` removes the spare (its lock is free)."""
    write_policy(proj, "spare", egress=egress_for(upstreams, allow_private=[upstreams.subnet]))

    def worker_with_a_spare() -> tuple[subprocess.Popen[str], str]:
        tid = submit_task(proj, "spare", "true")
        w = subprocess.Popen(
            [FILA_SCRIPT, "worker", "--root", str(proj), "--quiet"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 90
        while not (record(proj, tid)["status"] == "needs_review" and untaken_spare(proj)):
            assert w.poll() is None and time.monotonic() < deadline, (w.poll(), record(proj, tid)["status"])
            time.sleep(0.2)
        rec = record(proj, tid)
        # The job took the spare the worker made for the queued task: no gateway start of its own.
        assert "gateway_take" in rec["timings"] and "gateway_start" not in rec["timings"], rec["timings"]
        return w, tid

    # The allowed counterpart: SIGTERM, and the worker removes its spare itself.
    w, tid = worker_with_a_spare()
    w.terminate()
    assert w.wait(timeout=60) == 0, w.stderr.read() if w.stderr else ""
    assert leftovers(docker_client, proj, tid) == []
    # SIGKILL: the spare (gateway, holder, network, directory and lock) stays until `fila recover`.
    w, tid = worker_with_a_spare()
    w.kill()
    w.wait(timeout=30)
    left = leftovers(docker_client, proj, tid)
    assert sum(x.startswith("container fila-gw-spare-") for x in left) >= 2, left
    assert any(x.startswith("network fila-net-spare-") for x in left) and "the gateway directory" in left, (
        left
    )
    rec = fila(proj, "recover", "--json")
    assert rec.exit_code == 0, rec.output
    assert leftovers(docker_client, proj, tid) == []


def test_a_one_shots_reaper_removes_its_spare_after_it_and_a_killed_reaper_leaves_it_to_recovery(
    proj: Path, upstreams: Upstreams, docker_client: docker.DockerClient
) -> None:
    """A one-shot process hands the spare it is done with to a detached reaper
    (sandbox/docker/reap.py) instead of waiting for its removal: the reaper removes the
    gateway, the holder, the network and the spare's lock, then its own lock. A reaper killed
    before it finished leaves its lock free and the rest to recovery."""
    from fila.sandbox.gateways import busy

    backend = DockerBackend()
    spares = proj / "sandbox" / "spares"

    def spare() -> egress.Gateway:
        pool = backend.spare_gateways(spares, {"fila.root": str(proj)}, refill=False)
        assert pool is not None
        pool.want(upstreams.network)
        gw = pool.take(upstreams.network)
        assert gw is not None and gw.netns is not None
        backend.gateways = None  # the next call makes a new pool, as a new process would
        return gw

    try:
        gw = spare()
        assert backend.handoff_gateways([gw], spares)
        reaped(spares)
        assert leftovers(docker_client, proj, "none") == []  # its log too: it had nothing to say
        gw = spare()
        assert backend.handoff_gateways([gw], spares)
        (lock,) = busy(spares)
        pids, deadline = [], time.monotonic() + 5
        while not pids and time.monotonic() < deadline:  # its command line once it is exec'd
            pids = reapers(str(lock))
        assert len(pids) == 1, pids
        (pid,) = pids
        os.kill(pid, 9)  # before its interpreter has even imported what it needs
        reaped(spares, timeout_s=10)
        left = leftovers(docker_client, proj, "none")
        assert f"container {gw.container}" in left and f"network {gw.network}" in left, left
        # What a finished reaper wrote is said by recovery, once.
        (spares / "reap-0123456789ab.log").write_text("network fila-net-x: still in use\n")
        rec = fila(proj, "recover")
        assert (
            rec.exit_code == 0 and "a one-shot's reaper said: network fila-net-x: still in use" in rec.stdout
        )
        assert leftovers(docker_client, proj, "none") == []
    finally:
        backend.close()


def test_a_one_shots_reaper_runs_isolated_from_the_callers_directory_and_its_route_credential(
    proj: Path, upstreams: Upstreams, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    """The reaper is a detached interpreter: neither a module planted in the directory `fila`
    runs from (a shared /tmp, a checkout holding an engine's `docker.py`) nor the route's
    credential in the caller's environment reaches it (sandbox/docker/reap.py: `python -I`, run
    from /, only the daemon's variables). The counterpart: the planted modules do run for a plain
    interpreter started in that directory."""
    secret = f"sk-test-{secrets.token_hex(16)}"
    env = {KEY_VAR: secret}
    planted, marker = tmp_path / "planted-cwd", tmp_path / "planted-ran"
    (planted / "fila").mkdir(parents=True)
    plant = f"open({str(marker)!r}, 'a').write(__name__ + chr(10))\n"
    (planted / "fila" / "__init__.py").write_text(plant)
    (planted / "docker.py").write_text(plant)
    probe = subprocess.run([sys.executable, "-c", "import docker"], cwd=planted, check=False)
    assert probe.returncode == 0 and marker.read_text() == "docker\n"  # the plant works
    marker.unlink()
    write_policy(
        proj,
        "reap",
        egress=egress_for(upstreams, routes=anthropic_route(upstreams), allow_private=[upstreams.subnet]),
    )
    upstreams.set_script([{"reply": {"text": "hi"}, "usage": {"input_tokens": 1, "output_tokens": 1}}])
    tid = submit_task(
        proj, "reap", 'curl -sS --max-time 10 -X POST "$ANTHROPIC_BASE_URL/v1/messages"', env=env
    )
    res = run_once(proj, env, cwd=planted)
    assert res.returncode == 0, res.stderr
    environs: list[bytes] = []
    deadline = time.monotonic() + 10
    while not environs and time.monotonic() < deadline:  # the reaper while it works
        for pid in reapers("fila.sandbox.docker.reap"):
            with contextlib.suppress(OSError):
                environs.append(Path(f"/proc/{pid}/environ").read_bytes())
    assert environs, "no reaper seen after the one-shot exited"
    assert not any(secret.encode() in e or KEY_VAR.encode() in e for e in environs)
    assert leftovers(docker_client, proj, tid) == []  # it did its work, and said nothing
    assert not marker.exists(), marker.read_text()


# -- gVisor ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("network", ["none", "allowlist"])
def test_runsc_runs_the_engine_in_gvisor_under_none_and_allowlist(
    proj: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    network: str,
) -> None:
    if "runsc" not in (docker_client.info().get("Runtimes") or {}):
        pytest.fail("runsc is not registered in Docker: run scripts/docker-up as root")
    extra = (
        {"egress": egress_for(upstreams, allow_private=[upstreams.subnet])} if network == "allowlist" else {}
    )
    write_policy(proj, "gvisor", network=network, runtime="runsc", **extra)
    cmd = (
        'echo "kernel: $(uname -r)"; '
        'echo "allowed: $(curl -sS --max-time 10 --cacert ca.crt https://allowed.test/ 2>&1)"; '
        'echo "denied: $(curl -sS --max-time 10 --cacert ca.crt -o /dev/null -w "%{http_connect}" '
        'https://denied.test/ 2>/dev/null)"'
    )
    tid = submit_task(proj, "gvisor", cmd)
    watch = Inspector(docker_client, proj)
    watch.start()
    try:
        res = run_once(proj, {})
    finally:
        watch.stop.set()
        watch.join()
    rec = record(proj, tid)
    assert res.returncode == 0 and rec["status"] == "needs_review", (res.stderr, rec["error"])
    log = (proj / rec["log_path"]).read_text()
    lines = dict(line.split(": ", 1) for line in log.splitlines() if ": " in line)
    assert watch.seen["engine"]["HostConfig"]["Runtime"].startswith("runsc"), watch.seen["engine"][
        "HostConfig"
    ]
    assert lines["kernel"] != os.uname().release, log  # gVisor's own kernel answers
    if network == "allowlist":
        assert lines["allowed"] == "hello from allowed.test" and lines["denied"] == "403", log
    else:
        assert "hello from" not in lines["allowed"] and rec["egress"] is None, log
    assert leftovers(docker_client, proj, tid) == []


# -- the record's reader ---------------------------------------------------------------------------


def test_the_gateway_log_is_read_capped_and_never_through_a_link(tmp_path: Path) -> None:
    line = {"door": "route", "route": "anthropic", "allowed": True, "status": 200,
            "usage": {"input_tokens": 2, "output_tokens": 1}}  # fmt: skip
    log = tmp_path / "egress.jsonl"
    log.write_text("\n".join([json.dumps(line)] * 5 + ["not json"]) + "\n")
    rec = egress.read_log(log, keep=3)
    assert (len(rec.requests), rec.dropped, rec.routes["anthropic"].input_tokens) == (3, 3, 10)
    capped = egress.read_log(log, cap=len(json.dumps(line)) * 2 + 5)
    assert capped.allowed == 2 and capped.dropped == 1
    link = tmp_path / "link.jsonl"
    link.symlink_to(log)
    assert egress.read_log(link).requests == [] and egress.read_log(link).dropped == 1


def test_a_route_call_left_in_flight_is_counted_and_the_summary_gives_the_totals(tmp_path: Path) -> None:
    # The gateway writes a route call's line when it is sent and again (same id) when it ends.
    sent = {"id": "a", "door": "route", "route": "anthropic", "allowed": True, "status": None,
            "reason": "in flight"}  # fmt: skip
    done = {**sent, "status": 200, "reason": None, "usage": {"input_tokens": 7, "output_tokens": 3}}
    log = tmp_path / "egress.jsonl"
    log.write_text(json.dumps(sent) + "\n" + json.dumps(done) + "\n")
    rec = egress.read_log(log)
    assert (rec.in_flight, len(rec.requests), rec.allowed) == (0, 1, 1)
    assert rec.routes["anthropic"].input_tokens == 7
    assert not any("in flight" in x for x in egress.lines(rec))
    # A gateway killed during the second call: its line stays in flight, and the record says so.
    log.write_text("\n".join(json.dumps(x) for x in (sent, done, {**sent, "id": "b"})) + "\n")
    rec = egress.read_log(log)
    assert rec.in_flight == 1 and len(rec.requests) == 2
    assert any("1 route calls were in flight" in x and "unmetered" in x for x in egress.lines(rec))
    # summary.json (the gateway's totals, also past its log cap) wins over what the log kept.
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({
        "allowed": 900, "denied": 5000, "budget_exhausted": None, "suppressed": {"proxy denied: x": 4990},
        "routes": {"anthropic": {"requests": 3, "statuses": {"200": 3}, "input_tokens": 10_007,
                                 "output_tokens": 3}},
        "in_flight": 0,
    }))  # fmt: skip
    rec = egress.read_log(log, summary=summary)
    assert (rec.allowed, rec.denied, rec.routes["anthropic"].input_tokens) == (900, 5000, 10_007)
    assert rec.dropped == 4990 and rec.in_flight == 1
    link = tmp_path / "summary-link.json"
    link.symlink_to(summary)
    assert egress.read_log(log, summary=link).routes["anthropic"].input_tokens == 7  # not followed


def test_a_denial_logged_after_the_last_summary_write_is_still_counted(tmp_path: Path) -> None:
    # The gateway rewrites summary.json at most every half second for a denial, and fila reads it
    # while the gateway runs: the log already has the denial the summary does not have yet.
    log = tmp_path / "egress.jsonl"
    lines = [{"door": "proxy", "host": "allowed.test", "allowed": True, "status": 200},
             {"door": "proxy", "host": "denied.test", "allowed": False, "status": 403}]  # fmt: skip
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"allowed": 1, "denied": 0, "routes": {}, "suppressed": {}}))
    rec = egress.read_log(log, summary=summary)
    assert (rec.allowed, rec.denied) == (1, 1)
    # A summary ahead of the log (lines past its cap) still gives the totals.
    summary.write_text(json.dumps({"allowed": 1, "denied": 7, "routes": {}, "suppressed": {"x": 6}}))
    ahead = egress.read_log(log, summary=summary)
    assert (ahead.denied, ahead.dropped) == (7, 6)


def test_credentials_a_route_upstream_echoed_reach_the_record_and_a_plain_warning(tmp_path: Path) -> None:
    normal = {"id": "a", "door": "route", "route": "anthropic", "allowed": True, "status": 200,
              "usage": {"input_tokens": 5, "output_tokens": 1}}  # fmt: skip
    echoed = {**normal, "id": "b", "scrubbed": {"header": 1, "body:base64": 2}}
    invented = {"door": "route", "route": "v1", "allowed": False, "status": 404, "reason": "unknown route"}
    log = tmp_path / "egress.jsonl"
    # Allowed counterpart: a normal call, nothing echoed, no warning.
    log.write_text(json.dumps(normal) + "\n")
    rec = egress.read_log(log)
    assert rec.routes["anthropic"].scrubbed == {} and egress.scrub_messages(rec) == []
    assert not any("scrubbed" in x for x in egress.lines(rec))
    # The log alone: counted per kind on its route; a made-up route name is a denial, not a route.
    log.write_text("".join(json.dumps(x) + "\n" for x in (normal, echoed, invented)))
    rec = egress.read_log(log)
    assert rec.routes["anthropic"].scrubbed == {"header": 1, "body:base64": 2}
    assert list(rec.routes) == ["anthropic"] and (rec.allowed, rec.denied) == (2, 1)
    assert rec.requests[1].scrubbed == {"header": 1, "body:base64": 2}
    # summary.json's per-route totals carry them too (and a route fila never configured is dropped).
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({
        "allowed": 2, "denied": 1, "suppressed": {}, "in_flight": 0,
        "routes": {
            "anthropic": {"requests": 2, "statuses": {"200": 2}, "input_tokens": 10, "output_tokens": 2,
                          "scrubbed": {"header": 1, "body:base64": 2, "refused:compressed": 1}},
            "anthropic@host:80": {"requests": 1, "statuses": {"404": 1}},
        },
    }))  # fmt: skip
    rec = egress.read_log(log, summary=summary, routes=["anthropic", "openai"])
    assert list(rec.routes) == ["anthropic"]
    assert rec.routes["anthropic"].scrubbed == {"header": 1, "body:base64": 2, "refused:compressed": 1}
    assert any(
        x.startswith("route     anthropic: 2 requests")
        and "credential scrubbed (body:base64: 2, header: 1, refused:compressed: 1)" in x
        for x in egress.lines(rec)
    ), egress.lines(rec)
    assert egress.scrub_messages(rec) == [
        "the upstream of route anthropic echoed the injected credential 3 times (body:base64 2, header 1); "
        "it was replaced before the engine saw it",
        "the upstream of route anthropic sent 1 compressed answers although the gateway asked for none; "
        "they were refused (the engine got 502) as they could hide the credential",
    ]


# -- a gateway that dies or is not ready in time ---------------------------------------------------


def _gateway_policy(ups: Upstreams) -> Any:
    from fila.core.models import Policy

    return Policy.model_validate(
        {"network": "allowlist", "max_timeout_ms": 60_000, "default_timeout_ms": 60_000,
         "egress": egress_for(ups, allow_private=[ups.subnet])}
    )  # fmt: skip


def test_a_builds_gateway_is_halted_before_its_log_is_read(
    tmp_path: Path, upstreams: Upstreams, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project Dockerfile's build reaches the network through a gateway of its own
    (sandbox/docker/envstore.build_gateway): it serves during the build and is halted before its
    log is read, as a job's is after its engine (a RUN step the daemon has not stopped yet
    cannot have a request forwarded that the record misses)."""
    from fila.sandbox.docker import envstore

    running_at_read: list[bool] = []
    real_read = docker_egress.read

    def read(client: docker.DockerClient, gw: egress.Gateway) -> Any:
        running_at_read.append(bool(client.api.inspect_container(gw.container)["State"]["Running"]))
        return real_read(client, gw)

    monkeypatch.setattr(docker_egress, "read", read)
    tid = f"bgw-{secrets.token_hex(3)}"
    policy = _gateway_policy(upstreams)
    with envstore.build_gateway(
        docker_client, job_id=tid, policy=policy, state=tmp_path / tid, labels={}
    ) as bg:
        (gw,) = docker_client.containers.list(filters={"label": [f"fila.job={tid}", "fila.role=gateway"]})
        assert gw.status == "running" and bg.network  # serving while the build runs
    assert running_at_read == [False] and bg.egress is not None, (running_at_read, bg)
    assert leftovers(docker_client, tmp_path, tid) == []


def test_a_gateway_that_dies_or_is_late_is_an_infra_error_and_leaves_nothing(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fila.core.errors import InfraError
    from fila.sandbox.docker.backend import run_as

    uid, gid = run_as()
    policy = _gateway_policy(upstreams)

    def start(tid: str, **kw: Any) -> egress.Gateway:
        return docker_egress.start(
            docker_client, job_id=tid, policy=policy, state=tmp_path / tid, labels={}, uid=uid, gid=gid, **kw
        )

    # The allowed counterpart: the real gateway gets ready and is removed with its network.
    gw = start("gw-ok")
    assert gw.ip and (tmp_path / "gw-ok" / "log" / "ready").exists()
    docker_egress.stop(docker_client, gw)
    assert leftovers(docker_client, tmp_path, "gw-ok") == [] and not (tmp_path / "gw-ok").exists()
    # Not ready in time: an infra error naming the limit.
    late, dead = f"gw-late-{secrets.token_hex(3)}", f"gw-dead-{secrets.token_hex(3)}"  # this run's only
    with pytest.raises(InfraError, match=r"not ready within 0\.01 s"):
        start(late, ready_timeout_s=0.01)
    # A gateway image whose process exits at once: an infra error with its exit code and log.
    monkeypatch.setattr(egress, "GATEWAY_IMAGE", "fila/testnet:latest")
    monkeypatch.setattr(docker_egress, "GATEWAY_IMAGE", "fila/testnet:latest")  # imported by name there
    with pytest.raises(InfraError, match=r"the gateway exited \(code \d+\) before it was ready"):
        start(dead)
    for tid in (late, dead):
        assert docker_client.containers.list(all=True, filters={"label": f"fila.job={tid}"}) == []
        assert docker_client.networks.list(filters={"label": f"fila.job={tid}"}) == []
        assert not (tmp_path / tid).exists()


def test_the_gateway_files_are_private_and_outside_the_job_directory(tmp_path: Path) -> None:
    import stat

    from fila.core.models import Policy
    from fila.sandbox.docker.backend import run_as

    key = f"sk-{secrets.token_hex(8)}"
    os.environ[KEY_VAR] = key
    try:
        policy = Policy.model_validate(
            {"network": "allowlist", "max_timeout_ms": 1000, "default_timeout_ms": 1000,
             "egress": {"allow": [{"host": "example.com"}], "routes": {"openai": {"credential": KEY_VAR}},
                        "max_tokens": 100}}
        )  # fmt: skip
        uid, gid = run_as()
        state = tmp_path / "sandbox" / "meta" / "job" / "egress"
        state.parent.mkdir(parents=True)
        egress.prepare_gateway_dir(state, policy, "job", uid, gid, clients=["10.213.9.0/24"])
    finally:
        del os.environ[KEY_VAR]
    secret = state / "secrets" / "openai"
    assert secret.read_text() == key
    assert stat.S_IMODE(state.stat().st_mode) == 0o700 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "secrets").stat().st_mode) == 0o700
    assert (secret.stat().st_uid, (state / "log").stat().st_uid) == (uid, uid)  # the gateway's user
    config = json.loads((state / "conf" / "config.json").read_text())
    assert key not in (state / "conf" / "config.json").read_text()
    want = {"upstream": "https://api.openai.com", "header": "authorization", "format": "Bearer {key}"}
    # paths null: the gateway's default for the known route (its model calls only).
    assert config["routes"]["openai"] == want | {"secret": "openai", "paths": None}
    assert config["clients"] == ["10.213.9.0/24"]
    # The host's own addresses go to the gateway, which never connects to them.
    assert "127.0.0.1" in config["host_addresses"] and config["host_addresses"] == egress.host_addresses()
    assert any(not a.startswith("127.") and ":" not in a for a in config["host_addresses"])
    assert config["budget"] == {"max_requests": None, "max_tokens": 100}


def test_a_route_paths_override_reaches_the_gateway_config(tmp_path: Path) -> None:
    from fila.core.models import Policy
    from fila.sandbox.docker.backend import run_as

    os.environ[KEY_VAR] = "k"
    try:
        paths = ["POST /v1/chat/completions", "GET /v1/files/*"]
        doc = {"network": "allowlist", "max_timeout_ms": 1000, "default_timeout_ms": 1000,
               "egress": {"routes": {"openai": {"credential": KEY_VAR, "paths": paths}}}}  # fmt: skip
        policy = Policy.model_validate(doc)
        egress.validate(policy)
        uid, gid = run_as()
        egress.prepare_gateway_dir(tmp_path / "egress", policy, "job", uid, gid, clients=["10.213.9.0/24"])
    finally:
        del os.environ[KEY_VAR]
    config = json.loads((tmp_path / "egress" / "conf" / "config.json").read_text())
    assert config["routes"]["openai"]["paths"] == paths


def test_a_real_key_in_the_engine_environment_is_replaced_by_the_placeholder(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    images: ImageRef,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fila.sandbox.docker import backend as sandbox

    secret = f"sk-{secrets.token_hex(8)}"
    job_dir = tmp_path / "jobs" / "key-job"
    (job_dir / "input").mkdir(parents=True)
    (job_dir / "work").mkdir()

    def spec(policy: Any) -> sandbox.RunSpec:
        return sandbox.RunSpec(
            job_id="key-job", workspace=CopyWorkspace(job_dir),
            image="fila/testnet:latest",
            argv=["sh", "-c", 'echo "key=$ANTHROPIC_API_KEY"'], env={"ANTHROPIC_API_KEY": secret},
            policy=policy, limits=None, timeout_ms=30_000, log_path=tmp_path / "key.log", labels={},
            egress_dir=tmp_path / "egress",
        )  # fmt: skip

    from fila.core.models import Policy

    # Under network none the adapter's variable reaches the engine as given (the counterpart)...
    none = Policy.model_validate({"network": "none", "max_timeout_ms": 60_000, "default_timeout_ms": 60_000})
    sandbox.run(spec(none), client=docker_client)
    assert (tmp_path / "key.log").read_text().strip() == f"key={secret}"
    # ...under allowlist with the route, the gateway's placeholder replaces it.
    monkeypatch.setenv(KEY_VAR, "sk-the-real-one")
    policy = _gateway_policy(upstreams).model_copy(deep=True)
    policy.egress.routes = Policy.model_validate(
        {"max_timeout_ms": 1, "default_timeout_ms": 1, "network": "allowlist",
         "egress": {"routes": anthropic_route(upstreams)}}
    ).egress.routes  # fmt: skip
    sandbox.run(spec(policy), client=docker_client)
    assert (tmp_path / "key.log").read_text().strip() == f"key={egress.PLACEHOLDER_KEY}"


def gateway_pids(client: docker.DockerClient, container: str) -> list[int]:
    """The host pids of a running container's processes: its init and that init's descendants."""
    todo = [int(client.api.inspect_container(container)["State"]["Pid"])]
    found: list[int] = []
    while todo:
        pid = todo.pop()
        found.append(pid)
        with contextlib.suppress(FileNotFoundError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return found


def job_spec(tmp_path: Path, tid: str, argv: list[str], policy: Any) -> Any:
    """A RunSpec of job `tid` (its directory under `tmp_path`, input/ and work/ made) running
    `argv` in fila/testnet under `policy`, its log and gateway directory beside it."""
    from fila.sandbox.docker import backend as sandbox

    job_dir = tmp_path / tid
    (job_dir / "input").mkdir(parents=True)
    (job_dir / "work").mkdir()
    return sandbox.RunSpec(
        job_id=tid, workspace=CopyWorkspace(job_dir),
        image="fila/testnet:latest", argv=argv, env={}, policy=policy, limits=None, timeout_ms=30_000,
        log_path=tmp_path / f"{tid}.log", labels={}, egress_dir=tmp_path / f"{tid}.egress",
    )  # fmt: skip


def test_a_gateway_that_dies_during_the_run_is_a_warning_of_the_result(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    images: ImageRef,
) -> None:
    from fila.sandbox.docker import backend as sandbox

    def run(tid: str, kill: bool) -> sandbox.RunResult:
        spec = job_spec(tmp_path, tid, ["sh", "-c", "sleep 3"], _gateway_policy(upstreams))
        killed: list[str] = []

        def killer() -> None:
            deadline = time.monotonic() + 20
            while kill and not killed and time.monotonic() < deadline:
                engines = docker_client.containers.list(
                    filters={"label": f"fila.job={tid}", "status": "running"}
                )
                # The gateway and the engine, the gateway serving (the engine may start while
                # the gateway is only listening: dying then is the start's failure, not the run's).
                serving = (tmp_path / f"{tid}.egress" / "log" / "ready").exists()
                if len(engines) == 2 and serving:
                    (gw,) = [c for c in engines if c.labels.get("fila.role") == "gateway"]
                    gw.kill()
                    killed.append(gw.name)
                time.sleep(0.1)

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        res = sandbox.run(spec, client=docker_client)
        t.join()
        assert bool(killed) == kill
        return res

    calm = run("gw-calm", kill=False)
    assert calm.exit_code == 0 and not any("gateway" in w for w in calm.warnings), calm.warnings
    res = run("gw-killed", kill=True)
    assert any("the job's gateway exited during the run" in w for w in res.warnings), res.warnings
    assert leftovers(docker_client, tmp_path, "gw-killed") == []


def test_containers_on_fila_egress_network_cannot_reach_each_other(
    docker_client: docker.DockerClient, images: ImageRef
) -> None:
    """Every job's gateway sits on the default egress network: one must never reach another's
    routes port (and with it another job's key)."""
    docker_egress.ensure_egress_network(docker_client, egress.DEFAULT_EGRESS_NETWORK)
    opts = docker_client.networks.get(egress.DEFAULT_EGRESS_NETWORK).attrs["Options"]
    assert opts.get("com.docker.network.bridge.enable_icc") == "false", opts
    own = f"fila-test-icc-{secrets.token_hex(4)}"
    create_on_free_subnet(docker_client, own, options={}, labels={"fila.test": "icc"})
    knock = (
        "import socket,sys; s=socket.socket(); s.settimeout(3)\n"
        "try:\n s.connect((sys.argv[1], 8000)); print('connected')\n"
        "except OSError as e:\n print('refused', e)"
    )

    def reach(network: str) -> str:
        kw: dict[str, Any] = dict(
            network=network, user="65534:65534", cap_drop=["ALL"], labels={"fila.test": "icc"}
        )
        server = docker_client.containers.run(
            "fila/testnet:latest", ["python3", "-m", "http.server", "8000"], detach=True, **kw
        )
        try:
            server.reload()
            ip = server.attrs["NetworkSettings"]["Networks"][network]["IPAddress"]
            time.sleep(1)  # the server binds
            out = docker_client.containers.run(
                "fila/testnet:latest", ["python3", "-c", knock, ip], remove=True, **kw
            )
            return out.decode().strip()
        finally:
            server.remove(force=True)

    try:
        assert reach(own) == "connected"  # the counterpart: a network that allows it
        assert reach(egress.DEFAULT_EGRESS_NETWORK).startswith("refused")
    finally:
        docker_client.networks.get(own).remove()


def test_a_runtime_docker_lacks_is_refused_before_the_gateway_or_any_container_starts(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    images: ImageRef,
) -> None:
    from fila.core.errors import InfraError
    from fila.sandbox.docker import backend as sandbox

    def spec(tid: str, runtime: str) -> sandbox.RunSpec:
        return job_spec(
            tmp_path, tid, ["true"], _gateway_policy(upstreams).model_copy(update={"runtime": runtime})
        )

    def events(since: float, tid: str) -> list[str]:
        seen = docker_client.events(since=int(since), until=int(time.time()) + 1, decode=True)
        return [f"{e['Type']} {e['Action']}" for e in seen if tid in json.dumps(e)]

    # The counterpart: runsc under allowlist (gVisor on the job network) creates what it needs.
    t0 = time.time()
    assert sandbox.run(spec("rt-ok", "runsc"), client=docker_client).exit_code == 0
    assert "network create" in events(t0, "rt-ok") and "container start" in events(t0, "rt-ok")
    t0 = time.time()
    with pytest.raises(InfraError, match="fila-no-such-rt") as info:
        sandbox.run(spec("rt-missing", "fila-no-such-rt"), client=docker_client)
    assert info.value.hint and "fila-no-such-rt" in info.value.hint
    assert events(t0, "rt-missing") == []  # no network, no gateway, no engine: nothing was made


def halt_target(client: docker.DockerClient, name: str, cmd: list[str]) -> Any:
    """A container halt's tests stop as if it were a gateway: fila/testnet under an init."""
    return client.containers.run(
        "fila/testnet:latest", cmd, name=name, detach=True, init=True, network_mode="none",
        labels={"fila.test": "halt"},
    )  # fmt: skip


def running_pids(client: docker.DockerClient, container: Any) -> list[int]:
    """gateway_pids of `container` once its init, shell and child all run (checked alive)."""
    deadline = time.monotonic() + 10
    while len(pids := gateway_pids(client, container.id)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 3 and all(Path(f"/proc/{p}").exists() for p in pids), pids
    return pids


def halted_all_gone(client: docker.DockerClient, container: Any, tmp_path: Path) -> egress.Gateway:
    """`container` (a halt_target, its three processes seen alive first) halted as a gateway:
    halt says so and none of its processes lives after; the Gateway, for what else it says."""
    pids = running_pids(client, container)
    gw = egress.Gateway("halt", "none", container.name, "", tmp_path, [])
    docker_egress.halt(client, gw)
    assert gw.halted and [p for p in pids if Path(f"/proc/{p}").exists()] == [], pids
    return gw


@pytest.mark.parametrize("events", ["die", "holder-dies-first", "none"])
def test_halt_returns_once_every_process_of_the_gateway_is_gone(
    tmp_path: Path, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch, events: str
) -> None:
    """egress.halt returns once the daemon's events say the gateway was killed, then died, before
    the daemon has cleaned up after it, or, where the engine gives no filtered events ("none"),
    on the kill's answer; either way every process of the container (its init, a shell and its
    child) is gone by then, and all of them were alive just before. The daemon's filter also
    matches a name that begins with the gateway's, its namespace holder's: a holder that is killed
    and dies first, once the stream is open ("holder-dies-first"), does not end the wait."""
    name = f"fila-test-halt-{secrets.token_hex(4)}"
    holder = None
    real_events = docker.APIClient.events
    if events == "none":

        def opened(*_a: Any, **_kw: Any) -> Any:
            raise docker.errors.APIError("this engine filters no events")

    else:

        def opened(*a: Any, **kw: Any) -> Any:
            stream = real_events(*a, **kw)
            if holder is not None:
                holder.kill()  # its `kill` and `die` are in the stream before the gateway's
            return stream

    monkeypatch.setattr(docker.APIClient, "events", opened)
    if events == "holder-dies-first":
        real_kill = docker.APIClient.kill

        def late_kill(api: Any, container: str, *a: Any, **kw: Any) -> Any:
            if container == name:
                time.sleep(1.0)  # the holder's `kill` and `die` are long in the stream by then
            return real_kill(api, container, *a, **kw)

        monkeypatch.setattr(docker.APIClient, "kill", late_kill)
    ctr = halt_target(docker_client, name, ["sh", "-c", "sleep 600 & wait"])
    if events == "holder-dies-first":
        holder = halt_target(docker_client, f"{name}-netns", ["sleep", "600"])
    try:
        halted_all_gone(docker_client, ctr, tmp_path)
        if holder is not None:
            holder.reload()
            assert holder.status == "exited"  # it died first, as the case says
    finally:
        for c in (ctr, holder):
            if c is not None:
                c.remove(force=True)


def test_halt_kills_only_once_another_processs_gateway_has_departed(
    tmp_path: Path, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two gateways leaving the shared egress network at once can deadlock Docker 20.10
    (sandbox/docker/removal.py): halt's kill waits while another process holds the daemon's
    departure lock (its gateway departing), then kills. The lock is this test's own (the host's
    belongs to the fila processes running beside it)."""
    from fila.sandbox.docker import removal

    lock = tmp_path / "docker.sock.fila-departures.lock"
    monkeypatch.setattr(removal, "departure_locks", lambda _client: [lock])
    first = halt_target(
        docker_client, f"fila-test-halt-{secrets.token_hex(4)}", ["sh", "-c", "sleep 600 & wait"]
    )
    second = halt_target(
        docker_client, f"fila-test-halt-{secrets.token_hex(4)}", ["sh", "-c", "sleep 600 & wait"]
    )
    try:
        # Allowed: nobody departing, halt kills at once.
        gw = halted_all_gone(docker_client, first, tmp_path)
        assert "gateway_depart" in gw.timings and "gateway_depart_unlocked" not in gw.timings
        # Blocked: another process's gateway departs; the kill waits for it.
        pids = running_pids(docker_client, second)
        gw = egress.Gateway("halt", "none", second.name, "", tmp_path, [])
        with held_elsewhere(lock) as release:
            halting = threading.Thread(target=docker_egress.halt, args=(docker_client, gw))
            halting.start()
            time.sleep(1.0)
            alive = [p for p in pids if Path(f"/proc/{p}").exists()]
            assert halting.is_alive() and alive == pids, "killed while another gateway departed"
            release()
            halting.join(30)
        assert gw.halted and [p for p in pids if Path(f"/proc/{p}").exists()] == [], pids
        assert gw.timings["gateway_depart"] >= 1.0, gw.timings  # the record says it waited
    finally:
        for c in (first, second):
            c.remove(force=True)


def test_a_gateway_dead_before_halt_is_never_taken_for_one_it_killed_whatever_the_clocks(
    tmp_path: Path, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """halt decides by the order of the daemon's events (`kill`, then `die`), not by comparing
    this host's clock with the daemon's (a daemon in a VM behind a Unix socket keeps its own):
    with the daemon's clock 5 s ahead of the host's, a running gateway is still halted (all its
    processes gone), and one that died on its own during the run (exit 7) is not taken for one
    halt killed: `died` reports it."""
    from fila.sandbox.docker import removal

    real_time, real_monotonic = time.time, time.monotonic

    class Ahead:  # the host's clock 5 s behind the daemon's, as halt sees it
        time = staticmethod(lambda: real_time() - 5.0)
        monotonic = staticmethod(real_monotonic)

    monkeypatch.setattr(docker_egress, "time", Ahead)
    alive = halt_target(
        docker_client, f"fila-test-halt-{secrets.token_hex(4)}", ["sh", "-c", "sleep 600 & wait"]
    )
    dead = halt_target(docker_client, f"fila-test-halt-{secrets.token_hex(4)}", ["sh", "-c", "exit 7"])
    try:
        halted_all_gone(docker_client, alive, tmp_path)
        assert dead.wait(timeout=30)["StatusCode"] == 7
        gone = egress.Gateway("halt", "none", dead.name, "", tmp_path, [])
        monkeypatch.setattr(removal, "departure_locks", lambda _client: [])  # none to take
        docker_egress.halt(docker_client, gone)
        assert not gone.halted
        # Not running: its removal takes no departure lock; and the record says its kill had none.
        assert gone.stopped and "gateway_depart_unlocked" in gone.timings, gone
        said = docker_egress.died(docker_client, gone)
        assert said is not None and "exited during the run (code 7" in said, said
    finally:
        for c in (alive, dead):
            c.remove(force=True)


def test_podmans_allowlist_run_halts_its_gateway_before_reading_its_log(
    tmp_path: Path, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Podman's allowlist run (sandbox/podman/egress.run) starts its own gateway and hands
    Docker's container.run the policy as `none`; its gateway is halted all the same before its
    log is read: at the read, it is halted and none of its processes lives. Run here through
    Docker's daemon, which speaks the same API: the libpod gateway's start is replaced by a
    running container standing in for it (alive, all three processes, before the run), the
    engine's container is real (network none), and the record's egress read is the real one's
    caller, asked only what it sees."""
    from fila.core.models import EgressRecord, Policy
    from fila.sandbox.docker import container as docker_container
    from fila.sandbox.podman import egress as podman_egress

    name = f"fila-test-halt-{secrets.token_hex(4)}"
    stand_in = halt_target(docker_client, name, ["sh", "-c", "sleep 600 & wait"])
    try:
        pids = running_pids(docker_client, stand_in)
        gw = egress.Gateway("pm", "none", name, "", tmp_path / "gw", [])
        monkeypatch.setattr(docker_container, "start_gateway", lambda *_a, **_kw: gw)
        at_read: list[tuple[bool, list[int]]] = []

        def read(_client: Any, g: egress.Gateway) -> Any:
            at_read.append((g.halted, [p for p in pids if Path(f"/proc/{p}").exists()]))
            return EgressRecord(), []

        monkeypatch.setattr(docker_egress, "read", read)
        monkeypatch.setattr(docker_egress, "remove", lambda *_a, **_kw: [])
        real_run = docker_container.run

        def run(spec: Any, **kw: Any) -> Any:
            assert spec.policy.network == "none"  # Podman's path: no Docker gateway of its own
            kw["create"] = lambda c, kwargs: c.containers.create(**kwargs)
            return real_run(spec, **kw)

        monkeypatch.setattr(docker_container, "run", run)
        policy = Policy.model_validate(
            {"network": "allowlist", "egress": {"allow": [{"host": "allowed.test", "port": 443}]},
             "max_timeout_ms": 60_000, "default_timeout_ms": 10_000}
        )  # fmt: skip
        spec = job_spec(tmp_path, "pm", ["sh", "-c", "true"], policy)
        res = podman_egress.run(
            spec, client=docker_client, create=lambda *_a: None, rootless=False, waive=frozenset()
        )
        assert res.exit_code == 0
        assert at_read == [(True, [])], at_read
    finally:
        stand_in.remove(force=True)


def test_halt_against_a_daemon_that_does_not_answer_fails_the_job_rather_than_hang(tmp_path: Path) -> None:
    """A daemon that takes connections and never answers (a wedged dockerd, an API proxy): a
    plain request fails on the client's timeout, and halt, which also waits on an event stream
    (no timeout of its own), raises InfraError at its own `timeout_s` instead of hanging."""
    import socket as socketlib

    from fila.core.errors import InfraError

    path = tmp_path / "docker.sock"
    srv = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(16)
    held: list[socketlib.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(srv.accept()[0])  # read nothing, answer nothing

    threading.Thread(target=serve, daemon=True).start()
    client = docker.DockerClient(base_url=f"unix://{path}", version="1.41", timeout=2)
    try:
        with pytest.raises(requests.exceptions.RequestException, match="timed out"):
            client.api.kill("fila-gw-x")
        outcome: list[BaseException | None] = []

        def go() -> None:
            try:
                docker_egress.halt(client, egress.Gateway("job", "none", "fila-gw-x", "", tmp_path, []), 2.0)
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        t.join(30)
        assert outcome and isinstance(outcome[0], InfraError), outcome
        assert "did not answer within 2 s" in str(outcome[0])
    finally:
        srv.close()
        for c in held:
            c.close()
        client.close()


def test_a_gateway_is_stopped_before_its_log_is_read_and_one_not_yet_serving_never_serves(
    tmp_path: Path,
    upstreams: Upstreams,
    docker_client: docker.DockerClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the engine has exited, its gateway is killed before its log is read, serving or not
    (egress.halt), which returns once every process of the gateway is gone (its init and
    mitmproxy: alive just before): nothing passes after the read, so the record holds all that
    passed. The engine starts while its gateway only listens (its connections wait in the queues): one that
    exits before the gateway serves ends the run at once, and what it left queued is never
    served: the record (no request) is what the upstream saw (none). The gateway's config is held back
    until the engine has exited, so that it cannot serve during the engine's life, then let in
    once the gateway is halted. The counterpart first: the same request from an engine that
    waits for it is served and recorded."""
    from fila.core.models import Policy
    from fila.sandbox.docker import backend as sandbox
    from fila.sandbox.docker import egress as docker_egress

    monkeypatch.setenv(KEY_VAR, f"sk-test-{secrets.token_hex(16)}")
    policy = Policy.model_validate(
        {"network": "allowlist", "max_timeout_ms": 60_000, "default_timeout_ms": 60_000,
         "egress": egress_for(upstreams, routes=anthropic_route(upstreams), allow_private=[upstreams.subnet])}
    )  # fmt: skip
    real_write, real_halt, real_read = (
        docker_egress.write_gateway_config,
        docker_egress.halt,
        docker_egress.read,
    )
    halted: list[bool] = []
    running_at_read: list[bool] = []
    held: list[bool] = []

    def read(client: Any, gw: egress.Gateway) -> Any:
        running_at_read.append(bool(client.api.inspect_container(gw.container)["State"]["Running"]))
        return real_read(client, gw)

    monkeypatch.setattr(docker_egress, "read", read)
    request = (
        'curl -sS --max-time 20 -X POST "$ANTHROPIC_BASE_URL/v1/messages" '
        f'-H "x-api-key: $ANTHROPIC_API_KEY" {MESSAGES}'
    )

    def held_write(state: Path, *a: Any, **kw: Any) -> Any:
        routes = real_write(state, *a, **kw)
        (state / "conf" / "config.json").rename(state / "conf" / "held.json")
        held.append(True)
        return routes

    def halt(client: Any, gw: egress.Gateway) -> None:
        # halt returns on the daemon's word that the gateway died, before its clean-up: by then
        # no process of the gateway lives (its init and mitmproxy, alive just before).
        pids = gateway_pids(client, gw.container)
        assert len(pids) >= 2 and all(Path(f"/proc/{p}").exists() for p in pids), pids
        real_halt(client, gw)
        assert [p for p in pids if Path(f"/proc/{p}").exists()] == [], pids
        halted.append(gw.halted)
        if held:
            (gw.dir / "conf" / "held.json").rename(gw.dir / "conf" / "config.json")
            time.sleep(1.0)  # a gateway still alive would load it now

    monkeypatch.setattr(docker_egress, "halt", halt)

    def run(tid: str, cmd: str) -> sandbox.RunResult:
        spec = job_spec(tmp_path, tid, ["sh", "-c", cmd], policy)
        upstreams.set_script([{"reply": {"text": "hello"}, "usage": {"input_tokens": 1, "output_tokens": 1}}])
        upstreams.clear_requests()
        res = sandbox.run(spec, client=docker_client)
        assert res.exit_code == 0 and not res.warnings, res.warnings
        assert res.egress is not None
        return res

    served = run("gw-serves", request)
    assert halted == [True]
    assert len(upstreams.requests("model.test")) == 1
    assert served.egress.routes["anthropic"].requests == 1, served.egress
    # A serving gateway is stopped too before its log is read: nothing passes after the read.
    assert running_at_read == [False], running_at_read
    monkeypatch.setattr(docker_egress, "write_gateway_config", held_write)
    # The whole request goes into the route door's queue; the engine exits without waiting.
    gone = run("gw-halted", f"{request} >/dev/null 2>&1 & sleep 1; exit 0")
    assert halted == [True, True] and held == [True]
    assert upstreams.requests("model.test") == []
    assert "anthropic" not in gone.egress.routes or gone.egress.routes["anthropic"].requests == 0
    assert leftovers(docker_client, tmp_path, "gw-halted") == []

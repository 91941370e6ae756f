"""Rootless Podman: the backend contract and the cycle, as an unprivileged user these tests create.

As root, `test_the_contract_and_the_cycle_pass_on_rootless_podman_as_an_ordinary_user` makes a
throwaway user (no docker group: the Docker socket is closed to it), and runs, as that user,
tests/test_backend_contract.py and the `as_user` tests of this module with
FILA_CONTRACT_BACKEND=podman; no Podman socket answers for a new user, so the backend starts
`podman system service` itself. The pure mapping of the request (libpod_spec) is tested here too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fila.ops.doctor import storage_note
from fila.sandbox.base import RunSpec
from fila.sandbox.docker import backend as dk
from fila.sandbox.docker.container import docker_error
from fila.sandbox.podman.backend import libpod_spec, overlay_why
from fila.workspace.strategy import CopyWorkspace, OverlayWorkspace
from tests.support.policy import policy
from tests.support.users import (
    podman_user,
    pytest_as_user,
    python_for_others,
    readable_tests_dir,
    selected_as_user,
)

AS_USER = os.environ.get("FILA_CONTRACT_BACKEND") == "podman" and os.getuid() != 0
as_user = pytest.mark.skipif(not AS_USER, reason="runs as the Podman test user (the root test starts it)")


def _kwargs(tmp_path: Path, **kw: object) -> dict[str, object]:
    job = tmp_path / "job"
    (job / "input").mkdir(parents=True, exist_ok=True)
    (job / "work").mkdir(exist_ok=True)
    spec = RunSpec(
        job_id="t1",
        workspace=CopyWorkspace(job),
        image="fila/shell:latest",
        argv=["sh", "-c", "true"],
        env={"A": "1"},
        policy=policy(**kw),
        limits=None,
        timeout_ms=1000,
        log_path=tmp_path / "log",
        labels={"fila.root": "/q"},
    )
    return dk.create_kwargs(spec, "fila-t1-x")


def test_libpod_spec_maps_every_hardening_flag_and_keeps_ulimits_and_limits(tmp_path: Path) -> None:
    body = libpod_spec(_kwargs(tmp_path, nofile=512, fsize="2m", memory="64m", pids=64), rootless=True)
    assert body["userns"] == {"nsmode": "keep-id"} and body["netns"] == {"nsmode": "none"}
    assert body["read_only_filesystem"] and body["no_new_privileges"] and body["cap_drop"] == ["ALL"]
    assert body["init"] and not body["privileged"] and body["ipcns"] == {"nsmode": "private"}
    assert {"type": "nofile", "soft": 512, "hard": 512} in body["r_limits"]
    assert {"type": "fsize", "soft": 2 << 20, "hard": 2 << 20} in body["r_limits"]
    assert body["resource_limits"]["memory"]["limit"] == 64 << 20
    assert body["resource_limits"]["pids"] == {"limit": 64}
    binds = {m["destination"]: m["options"] for m in body["mounts"] if m["type"] == "bind"}
    assert binds == {"/job": ["rbind", "ro"], "/job/input": ["rbind", "ro"], "/job/work": ["rbind", "rw"]}
    home = next(m for m in body["mounts"] if m["destination"] == "/home/fila")
    assert "U" in home["options"] and not any(o.startswith("uid=") for o in home["options"])
    assert body["labels"]["fila"] == "1" and body["labels"]["fila.job"] == "t1"


def test_libpod_spec_leaves_out_only_what_is_waived_and_refuses_keys_it_does_not_map(tmp_path: Path) -> None:
    kw = _kwargs(tmp_path)
    full = libpod_spec(kw, rootless=True)
    assert set(full["resource_limits"]) == {"memory", "cpu", "pids"}
    part = libpod_spec(kw, rootless=True, waive=frozenset({"memory", "pids"}))
    assert set(part["resource_limits"]) == {"cpu"}
    assert (
        libpod_spec(kw, rootless=True, waive=frozenset({"memory", "pids", "cpus"})).get("resource_limits")
        is None
    )
    # A flag create_kwargs gains later must not be dropped on Podman in silence.
    with pytest.raises(ValueError, match="devices"):
        libpod_spec({**kw, "devices": ["/dev/fuse"]}, rootless=True)
    with pytest.raises(ValueError, match="security_opt"):
        libpod_spec({**kw, "security_opt": ["seccomp=unconfined"]}, rootless=True)


def _overlay_kwargs(tmp_path: Path) -> dict[str, object]:
    from fila.workspace.overlay import Overlay

    job = tmp_path / "job"
    (job / "input").mkdir(parents=True, exist_ok=True)
    (job / "work").mkdir(exist_ok=True)
    ov = Overlay(tmp_path / "snap" / "tree", tmp_path / "ov" / "upper", tmp_path / "ov" / "work", 1, 1)
    spec = RunSpec(job_id="t1", workspace=OverlayWorkspace(job, ov), image="fila/shell:latest",
                   argv=["true"], env={}, policy=policy(), limits=None, timeout_ms=1000,
                   log_path=tmp_path / "log", labels={"fila.root": "/q"})  # fmt: skip
    return dk.create_kwargs(spec, "fila-t1-x")


def test_libpod_spec_gives_the_overlay_work_volume_as_a_podman_overlay_with_the_jobs_layers(
    tmp_path: Path,
) -> None:
    kw = _overlay_kwargs(tmp_path)
    body = libpod_spec(kw, rootless=True)
    assert body["overlay_volumes"] == [{
        "destination": "/job/work",
        "source": str(tmp_path / "snap" / "tree"),
        "options": [f"upperdir={tmp_path / 'ov' / 'upper'}", f"workdir={tmp_path / 'ov' / 'work'}"],
    }]  # fmt: skip
    binds = {m["destination"]: (m["source"], m["options"]) for m in body["mounts"] if m["type"] == "bind"}
    assert binds["/job/input"] == (str(tmp_path / "snap" / "tree"), ["rbind", "ro"])  # the snapshot: ro
    assert "/job/work" not in binds
    # An overlay option fila never asks for (metacopy, redirect_dir: the upper layer would no longer
    # hold whole files) is refused, not passed on or dropped.
    (work,) = [m for m in kw["mounts"] if m["Type"] == "volume"]  # type: ignore[attr-defined]
    opts = work["VolumeOptions"]["DriverConfig"]["Options"]
    for extra in ("metacopy=on", "redirect_dir=on"):
        bad = {
            **work,
            "VolumeOptions": {
                "DriverConfig": {"Name": "local", "Options": {**opts, "o": opts["o"] + f",{extra}"}}
            },
        }
        with pytest.raises(ValueError, match=extra.split("=")[0]):
            libpod_spec({**kw, "mounts": [*kw["mounts"][:2], bad]}, rootless=True)  # type: ignore[index]


# What `podman info` said on this host (Podman 4.3.1, rootless, vfs storage, no mount program).
_INFO = {"version": {"Version": "4.3.1"}, "host": {"security": {"rootless": True}},
         "store": {"graphDriverName": "vfs", "graphOptions": {}}}  # fmt: skip
_FS = "nodev\tproc\nnodev\toverlay\n"


def test_overlay_why_allows_the_measured_host_and_names_each_host_it_cannot_read() -> None:
    assert overlay_why(_INFO, "6.18.44", _FS) is None  # allowed: what was measured here
    fuse = {
        **_INFO,
        "store": {"graphOptions": {"overlay.mount_program": {"Executable": "/usr/bin/fuse-overlayfs"}}},
    }
    assert "fuse-overlayfs" in str(overlay_why(fuse, "6.18.44", _FS))
    assert "5.11" in str(overlay_why(_INFO, "5.10.0", _FS))
    assert "older than 4.3" in str(overlay_why({**_INFO, "version": {"Version": "4.2.0"}}, "6.18", _FS))
    assert "no overlay" in str(overlay_why(_INFO, "6.18", "nodev\tproc\n"))
    rootful = {**_INFO, "host": {"security": {"rootless": False}}}
    assert "only rootless" in str(overlay_why(rootful, "6.18.44", _FS))


# -- as the Podman test user ---------------------------------------------------------------------


def _cli(*args: str) -> tuple[int, str]:
    from fila.cli import app

    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


@as_user
def test_the_cycle_on_podman_refuses_an_unwaived_policy_and_records_a_waived_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = tmp_path / "q"
    q.mkdir()
    (q / "greeting.txt").write_text("hello\n")
    assert _cli("init", "--root", str(q), "--backend", "podman")[0] == 0
    monkeypatch.chdir(q)  # `fila images build` takes the backend of the root it is run in
    code, out = _cli("images", "build", "shell")
    assert code == 0 and "fila/shell:latest" in out, out
    # The doctor names Podman's storage driver as `podman info` does, and warns only of vfs.
    code, out = _cli("doctor", "--no-self-test", "--json", "--root", str(q))
    engine = next(c for c in json.loads(out)["checks"] if c["name"] == "engine")
    driver = subprocess.run(["podman", "info", "--format", "{{.Store.GraphDriverName}}"],
                            capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    assert code == 0 and engine["data"]["storage"] == driver != "", out
    assert ("SLOW STORAGE" in engine["detail"]) == (driver == "vfs"), engine
    assert storage_note({"name": "podman", "storage": "overlay"}) is None
    assert "fuse-overlayfs" in (storage_note({"name": "podman", "storage": "vfs"}) or "")
    code, tid = _cli("submit", "--root", str(q), "--engine", "shell", "--command",
                     "sed -i s/hello/world/ greeting.txt", "--target", "greeting.txt")  # fmt: skip
    assert code == 0
    _cli("run", "--once", "--root", str(q))
    rec = json.loads((q / "fila" / "out" / f"{tid.strip()}.json").read_text())
    assert rec["status"] == "failed" and rec["error"]["kind"] == "invalid"
    assert "cannot enforce" in rec["error"]["message"] and not rec["container_started"]
    assert rec["backend"] == "podman" and rec["waived"] == []

    pol = q / "policies" / "default.json"
    data = json.loads(pol.read_text())
    pol.write_text(json.dumps(data | {"waive": ["memory", "pids", "cpus"]}))
    code, tid = _cli("submit", "--root", str(q), "--engine", "shell", "--command",
                     "sed -i s/hello/world/ greeting.txt", "--target", "greeting.txt")  # fmt: skip
    tid = tid.strip()
    code, out = _cli("run", "--once", "--root", str(q))
    assert code == 0, out
    rec = json.loads((q / "fila" / "out" / f"{tid}.json").read_text())
    assert rec["status"] == "needs_review" and rec["backend"] == "podman"
    assert rec["waived"] == ["memory", "pids", "cpus"]
    code, out = _cli("review", tid, "--root", str(q))
    assert "backend   podman" in out and "WAIVED    memory, pids, cpus" in out, out
    assert _cli("apply", tid, "--yes", "--root", str(q))[0] == 0
    assert (q / "greeting.txt").read_text() == "world\n"
    code, out = _cli("recover", "--root", str(q))
    assert code == 0 and "(podman: " in out, out


@as_user
def test_recovery_on_podman_sweeps_a_container_no_worker_holds(tmp_path: Path) -> None:
    from fila.core.layout import Root
    from fila.recovery import recover as recovery
    from fila.sandbox.podman.backend import PodmanBackend

    q = Root.at(tmp_path / "q")
    assert _cli("init", "--root", str(q.path), "--backend", "podman")[0] == 0
    backend = PodmanBackend()
    job = tmp_path / "job"
    (job / "input").mkdir(parents=True)
    (job / "work").mkdir()
    spec = RunSpec(
        job_id="20260101-000000-abcdef",
        workspace=CopyWorkspace(job),
        image="fila/shell:latest",
        argv=["sh", "-c", "sleep 50"],
        env={"PATH": "/bin:/usr/bin"},
        policy=policy(waive=["memory", "pids", "cpus"]),
        limits=None,
        timeout_ms=55_000,
        log_path=tmp_path / "log",
        labels={"fila.root": str(q.path), "fila.worker": "gone-worker"},  # a worker killed mid-run
    )
    started = threading.Event()

    def run() -> None:
        with contextlib.suppress(Exception):  # its container is removed under it by recovery
            backend.run(spec, before_start=lambda _c: started.set())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30)
    time.sleep(1)
    assert [b.labels["fila.job"] for b in backend.find(root=str(q.path))] == [spec.job_id]
    rep = recovery.recover(q, ttl=1e9)
    assert rep.backend == "podman" and len(rep.containers_removed) == 1
    assert backend.find(root=str(q.path)) == []
    t.join(60)


@as_user
def test_a_worker_killed_while_its_podman_container_runs_is_recovered_and_the_container_removed(
    tmp_path: Path,
) -> None:
    from fila.sandbox.podman.backend import PodmanBackend

    backend = PodmanBackend()
    backend.build("shell", progress=lambda _m: None)  # reused when the contract built it
    q = tmp_path / "q"
    q.mkdir()
    (q / "greeting.txt").write_text("hello\n")
    assert _cli("init", "--root", str(q), "--backend", "podman")[0] == 0
    pol = q / "policies" / "default.json"
    pol.write_text(json.dumps(json.loads(pol.read_text()) | {"waive": ["memory", "pids", "cpus"]}))
    code, tid = _cli("submit", "--root", str(q), "--engine", "shell", "--command",
                     "echo world > greeting.txt; sleep 30", "--target", "greeting.txt")  # fmt: skip
    tid = tid.strip()
    env = {**os.environ, "FILA_ROOT": str(q), "FILA_CRASH_AT": "during_run"}
    res = subprocess.run([sys.executable, "-c", "from fila.cli import main; main()", "run", "--once"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == -9, res.stdout + res.stderr  # SIGKILLed with its container running
    left = backend.find(job_id=tid)
    assert [b.status for b in left] == ["running"]  # the counterpart: the crash left it behind
    # Its work/ is an overlay: the kernel's scratch directory is the container root's (a
    # subordinate uid), which the user cannot remove; recovery removes it with the container.
    scratch = q / "sandbox" / "meta" / tid / "overlay" / "work"
    assert (scratch / "work").exists() and (scratch / "work").stat().st_uid != os.getuid()
    code, out = _cli("recover", "--root", str(q))
    assert code == 0, out
    assert backend.find(job_id=tid) == []
    assert not (scratch / "work").exists()
    rec = json.loads((q / "fila" / "out" / f"{tid}.json").read_text())
    assert rec["status"] == "needs_human" and rec["container_started"], rec  # never run twice
    assert _cli("run", "--once", "--root", str(q))[0] == 0  # nothing is claimed again
    assert json.loads((q / "fila" / "out" / f"{tid}.json").read_text())["status"] == "needs_human"


_ENGINE_CHANGE = (
    "set -e; sed -i s/hello/world/ greeting.txt; rm src/gone.txt; chmod +x src/a.py; "
    "rm -r src/sub; mkdir src/sub; echo fresh > src/sub/new.txt; ln -s greeting.txt link; "
    "mv src/keep.txt src/moved.txt; if echo x > ../input/greeting.txt; then echo WROTE-INPUT; fi"
)


def _tree_state(top: Path) -> dict[str, tuple]:
    """Every entry's kind, mode, owner, ctime and content (or link target): a write shows."""
    out = {}
    for p in [top, *sorted(top.rglob("*"))]:
        st_ = p.lstat()
        data = os.readlink(p) if p.is_symlink() else (p.read_bytes() if p.is_file() else b"")
        out[str(p.relative_to(top))] = (st_.st_mode, st_.st_uid, st_.st_ctime_ns, data)
    return out


@as_user
def test_an_overlay_job_on_rootless_podman_writes_the_patch_the_copy_writes_and_leaves_the_snapshot_pristine(
    tmp_path: Path,
) -> None:
    from fila.core.layout import Root
    from fila.workspace import overlay

    q = tmp_path / "q"
    (q / "src" / "sub").mkdir(parents=True)
    (q / "greeting.txt").write_text("hello\n")
    for name, text in (("a.py", "print(1)\n"), ("gone.txt", "bye\n"), ("keep.txt", "keep\n")):
        (q / "src" / name).write_text(text)
    (q / "src" / "sub" / "old.txt").write_text("old\n")
    old = time.time() - 3600  # a project at rest: older than the racy window
    for p in [q / "greeting.txt", *(q / "src").rglob("*")]:
        os.utime(p, (old, old), follow_symlinks=False)
    assert _cli("init", "--root", str(q), "--backend", "podman")[0] == 0
    pol = q / "policies" / "default.json"
    pol.write_text(json.dumps(json.loads(pol.read_text()) | {"waive": ["memory", "pids", "cpus"]}))
    from fila.sandbox.podman.backend import PodmanBackend

    PodmanBackend().build("shell", progress=lambda _m: None)

    def run_one(env: dict[str, str]) -> dict:
        code, tid = _cli("submit", "--root", str(q), "--engine", "shell", "--command", _ENGINE_CHANGE,
                         "--target", "greeting.txt", "--target", "src")  # fmt: skip
        assert code == 0, tid
        res = CliRunner().invoke(__import__("fila.cli", fromlist=["app"]).app,
                                 ["run", "--once", "--root", str(q)], env=env)  # fmt: skip
        assert res.exit_code == 0, res.output
        return json.loads((q / "fila" / "out" / f"{tid.strip()}.json").read_text())

    copied = run_one({"FILA_WORKSPACE": "copy"})  # the counterpart: the full copy, on Podman too
    assert copied["workspace"]["strategy"] == "copy" and copied["backend"] == "podman"
    over = run_one({"FILA_WORKSPACE": ""})
    ws = over["workspace"]
    assert ws["strategy"] == "overlay" and ws["snapshot_how"] == "built", ws
    assert over["status"] == copied["status"] == "needs_review", over
    patch = (q / over["patch_path"]).read_bytes()
    assert patch == (q / copied["patch_path"]).read_bytes()  # byte for byte
    assert over["diffstat"] == copied["diffstat"] and len(over["diffstat"]["paths"]) == 8
    for part in (
        b"old mode 100644\nnew mode 100755",
        b"deleted file mode",
        b"+greeting.txt",
        b"src/moved.txt",
    ):
        assert part in patch
    ov = overlay.job_overlay(Root.at(q), over["id"])
    assert ov is not None
    lower_before = _tree_state(ov.lower)
    # The formats this mount wrote, which overlay.Layers reads: a deletion is a character device
    # 0/0 (the container root's, a subordinate uid), a directory deleted and made again carries
    # user.overlay.opaque; the untouched file was never copied up.
    white = (ov.upper / "src" / "gone.txt").lstat()
    assert stat.S_ISCHR(white.st_mode) and white.st_rdev == 0 and white.st_uid != os.getuid()
    assert stat.S_ISCHR((ov.upper / "src" / "keep.txt").lstat().st_mode)  # renamed away
    assert os.getxattr(ov.upper / "src" / "sub", "user.overlay.opaque") == b"y"
    assert sorted(p.name for p in (ov.upper / "src" / "sub").iterdir()) == ["new.txt"]  # no .wh. files
    # The engine owns what it wrote (keep-id: the user's own uid), and its write to input/ failed.
    assert (ov.upper / "greeting.txt").stat().st_uid == os.getuid()
    assert "WROTE-INPUT" not in (q / over["log_path"]).read_text()
    assert (ov.lower / "greeting.txt").read_text() == "hello\n"
    assert (ov.lower / "src" / "sub" / "old.txt").read_text() == "old\n"
    assert list(ov.scratch.iterdir()) == []  # the kernel's scratch, a subordinate uid's: emptied
    # in the namespace of the user's pause process, whose pid is read only from a runtime directory
    # of the user's alone (podman.check_runtime's rule): Podman's own layout passes it.
    assert PodmanBackend()._pause_pid() is not None
    # A later task on the unchanged project reuses the snapshot, which no run has changed.
    again = run_one({"FILA_WORKSPACE": ""})
    assert again["workspace"]["snapshot"] == ws["snapshot"] and again["workspace"]["snapshot_how"] == "reused"
    assert (q / again["patch_path"]).read_bytes() == patch
    assert _tree_state(ov.lower) == lower_before
    # apply lands the reviewed change; gc (as the user) then removes the job, whiteouts and all.
    code, out = _cli("apply", over["id"], "--yes", "--root", str(q))
    assert code == 0, out
    assert (q / "greeting.txt").read_text() == "world\n" and (q / "src" / "moved.txt").read_text() == "keep\n"
    assert sorted(p.name for p in (q / "src" / "sub").iterdir()) == ["new.txt"]
    assert os.readlink(q / "link") == "greeting.txt" and (q / "src" / "a.py").stat().st_mode & 0o100
    code, out = _cli("gc", "--older-than", "0s", "--root", str(q))
    assert code == 0, out
    assert not Root.at(q).overlay_dir(over["id"]).exists()


# -- the driver (root) ---------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.skipif(os.getuid() != 0, reason="creating an ordinary user for the test needs root")
@pytest.mark.skipif(shutil.which("podman") is None, reason="scripts/podman-up installs podman")
def test_the_contract_and_the_cycle_pass_on_rootless_podman_as_an_ordinary_user(
    request: pytest.FixtureRequest,
) -> None:
    python = python_for_others()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} an ordinary user may run")
    here = readable_tests_dir()  # the checkout may be below a 0700 directory (CI): then a readable copy
    # One user, one Podman service for the contract, the cycle and the streams (test_output_streams).
    files = ["test_backend_contract.py", "test_podman.py", "test_output_streams.py"]
    markexpr = request.config.option.markexpr
    with podman_user() as user:
        out = pytest_as_user(user, python, here, files, timeout=900, markexpr=markexpr)
    m = re.search(r"(\d+) passed", out)
    # every case the user's run selects (the contract on Podman, the cycle, the streams, the pure
    # ones) passed as the user: none skipped, none missing
    selected = selected_as_user(here, files, markexpr)
    assert m is not None and int(m.group(1)) == selected > 10 and "skipped" not in out, out[-3000:]


def test_a_podman_engine_error_says_check_podman_info_and_names_the_socket_fila_used(tmp_path: Path) -> None:
    import requests
    from docker.errors import DockerException

    from fila.core.errors import InfraError
    from fila.sandbox.podman.backend import PodmanBackend

    class Images:
        def get(self, tag: str) -> None:
            raise DockerException("connection reset by peer")

    class Client:  # a Podman API that fails every call
        images = Images()

        def close(self) -> None:
            pass

    sock = tmp_path / "run" / "podman.sock"
    backend = PodmanBackend(socket=sock, autostart=False)
    backend.connect = lambda timeout=None: Client()  # type: ignore[method-assign,assignment,return-value]
    # An image call (builds, look-ups) and a job's container call, both as the backend raises them.
    with pytest.raises(InfraError) as image_err:
        backend.image_info("fila/shell:latest")
    spec = RunSpec(
        job_id="t1",
        workspace=CopyWorkspace(tmp_path),
        image="fila/shell:latest",
        argv=["true"],
        env={},
        policy=policy(),
        limits=None,
        timeout_ms=1000,
        log_path=tmp_path / "log",
        labels={},
    )
    with pytest.raises(InfraError) as run_err, backend.client():
        raise docker_error(spec, "starting the container", requests.ConnectionError("refused"))
    for err in (image_err.value, run_err.value):
        assert err.hint and "`podman info`" in err.hint and str(sock) in err.hint, err.hint
        assert "docker" not in err.hint.lower(), err.hint
    assert run_err.value.hint and "retried" in run_err.value.hint
    # The Docker backend's own hint for the same error names Docker.
    assert "`docker info`" in (docker_error(spec, "x", requests.ConnectionError()).hint or "")

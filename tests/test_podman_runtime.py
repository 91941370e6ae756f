"""Podman's runtime directory is the user's alone: fila uses its own 0700 runtime
directory, socket and pause.pid, and refuses one another uid owns or may write into; it never writes
through a link there; the overlay scratch it removes is checked against its own job layout.

Run as root (chown needs it): root plays "this user" and uid 65534 (nobody) "another user". The
allowed counterparts start and talk to a real `podman system service` (root's, at a socket in the
test's directory; it exits 3 s after its last client).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fila.core.errors import EngineUnavailable
from fila.sandbox.podman import backend as podman
from fila.sandbox.podman import service as podman_service

pytestmark = [
    pytest.mark.skipif(os.getuid() != 0, reason="making another uid's directory needs root"),
    pytest.mark.skipif(shutil.which("podman") is None, reason="scripts/podman-up installs podman"),
]
OTHER = 65534  # another local user: nobody


@pytest.fixture(autouse=True)
def _short_lived_service(monkeypatch: pytest.MonkeyPatch) -> None:
    # the services these tests start end by themselves
    monkeypatch.setattr(podman_service, "SERVICE_IDLE_S", 3)


def _theirs(path: Path, mode: int = 0o777) -> Path:
    path.mkdir(mode=mode)
    os.chmod(path, mode)
    os.chown(path, OTHER, OTHER)
    return path


def _backend(socket: Path, said: list[str] | None = None) -> podman.PodmanBackend:
    return podman.PodmanBackend(socket=socket, say=(said if said is not None else []).append, timeout=20)


def _refusal(socket: Path) -> EngineUnavailable:
    with pytest.raises(EngineUnavailable) as e:
        _backend(socket).ping()
    assert e.value.hint, e.value
    return e.value


def test_fila_starts_podman_in_its_own_runtime_directory_and_refuses_one_another_user_made(
    tmp_path: Path,
) -> None:
    # Allowed: the user's own 0700 directory. fila starts the service there and talks to it.
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    sock = mine / "podman" / "podman.sock"
    said: list[str] = []
    b = _backend(sock, said)
    b.ping()
    assert stat.S_ISSOCK(sock.lstat().st_mode) and "started `podman system service`" in said[0]
    assert "host" in b.info()  # a real Podman answered
    conf = mine / "podman" / "fila-containers.conf"
    assert conf.read_text().startswith("[engine]") and not conf.stat().st_mode & 0o022
    assert stat.S_IMODE((mine / "podman").stat().st_mode) == 0o700

    # Blocked: the same layout made first by another user (world-writable, as a planter leaves it),
    # with links at the names fila writes. Nothing is sent, started or written through them.
    theirs = _theirs(_theirs(tmp_path / "theirs") / "podman")
    precious, log = tmp_path / "precious.txt", tmp_path / "victim.log"
    precious.write_text("victim precious data\n")
    for name, target in (("fila-containers.conf", precious), ("fila-service.log", log)):
        (theirs / name).symlink_to(target)
        os.lchown(theirs / name, OTHER, OTHER)
    err = _refusal(theirs / "podman.sock")
    assert str(theirs) in str(err) and f"uid {OTHER}" in err.message and "0777" in err.message, err
    assert precious.read_text() == "victim precious data\n" and not log.exists()
    assert not (theirs / "podman.sock").exists()

    # Blocked: one of its own whose mode lets others in; allowed again once it is 0700.
    os.chmod(mine / "podman", 0o770)
    err = _refusal(sock)
    assert "writable by group or others (mode 0770)" in err.message and str(mine / "podman") in str(err)
    os.chmod(mine / "podman", 0o700)
    _backend(sock).ping()

    # Blocked: a socket in its own directory that another user owns (it may answer as Podman).
    os.lchown(sock, OTHER, OTHER)
    err = _refusal(sock)
    assert "socket" in err.message and f"uid {OTHER}" in err.message and str(sock) in str(err)
    os.lchown(sock, 0, 0)
    _backend(sock).ping()


def test_the_default_runtime_directory_and_its_parent_must_both_be_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the socket is Podman's default (/tmp/podman-run-$UID/podman/podman.sock without
    XDG_RUNTIME_DIR), the runtime directory above the socket's is checked too: pause.pid is there."""
    run = tmp_path / "podman-run"
    monkeypatch.setattr(podman_service, "default_socket", lambda: run / "podman" / "podman.sock")
    b = podman.PodmanBackend(say=lambda _m: None)
    assert b.socket == run / "podman" / "podman.sock"
    b.ping()  # allowed: missing, so fila makes both and starts the service in them
    assert not any(d.stat().st_mode & 0o022 for d in (run, run / "podman"))
    os.chown(run, OTHER, OTHER)
    err = _refusal(run / "podman" / "podman.sock")
    assert f"uid {OTHER}" in err.message and str(run) in str(err)
    os.chown(run, 0, 0)
    b.ping()


def test_a_stale_link_in_the_users_own_runtime_directory_is_never_written_through(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    (mine / "podman").mkdir(parents=True, mode=0o700)
    precious = tmp_path / "precious.txt"
    precious.write_text("victim precious data\n")
    conf, log = mine / "podman" / "fila-containers.conf", mine / "podman" / "fila-service.log"
    conf.symlink_to(precious)
    log.symlink_to(precious)
    err = _refusal(mine / "podman" / "podman.sock")  # the log is a link: not opened
    assert str(log) in str(err) and "link" in err.message
    assert precious.read_text() == "victim precious data\n"
    assert conf.is_file() and not conf.is_symlink()  # the config's link was replaced, not followed
    log.unlink()
    _backend(mine / "podman" / "podman.sock").ping()  # allowed: its own log file
    assert log.is_file() and not log.is_symlink() and precious.read_text() == "victim precious data\n"


def test_pause_pid_is_read_only_from_the_users_own_runtime_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tmp = run / "libpod" / "tmp"
    tmp.mkdir(parents=True, mode=0o700)
    for d in (run, run / "libpod"):
        os.chmod(d, 0o700)
    pause = tmp / "pause.pid"
    pause.write_text(f"{os.getpid()}\n")
    b = _backend(run / "podman" / "podman.sock")
    assert b._pause_pid() == os.getpid()  # allowed: its own directory, file and process

    for d in (run, run / "libpod", tmp):
        os.chmod(d, 0o777)
        assert b._pause_pid() is None, d
        os.chmod(d, 0o700)
        os.chown(d, OTHER, OTHER)
        assert b._pause_pid() is None, d
        os.chown(d, 0, 0)
    assert b._pause_pid() == os.getpid()
    os.chown(pause, OTHER, OTHER)
    assert b._pause_pid() is None
    os.chown(pause, 0, 0)
    other = tmp_path / "other.pid"
    other.write_text(f"{os.getpid()}\n")
    pause.unlink()
    pause.symlink_to(other)
    assert b._pause_pid() is None  # a link is not followed, though it names a good file


def test_the_overlay_scratch_a_container_label_names_is_checked_against_the_job_layout(
    tmp_path: Path,
) -> None:
    root, job = tmp_path / "q", "20260101-000000-abcdef"
    scratch = root / "sandbox" / "meta" / job / "overlay" / "work"
    scratch.mkdir(parents=True)
    labels = {"fila.root": str(root), "fila.job": job}
    assert podman.job_scratch(labels) == scratch  # allowed: fila's own layout
    assert podman.job_scratch({**labels, "fila.job": "20260101-000000-000000"}) is None  # not there

    # A link on the way (`rm` follows the parents of its arguments): the victim's repository's
    # work/index would be removed as the user's namespace root.
    repo = tmp_path / "repo"
    (repo / "overlay" / "work").mkdir(parents=True)
    (repo / "overlay" / "work" / "index").write_text("the repository's index\n")
    overlay = scratch.parent
    overlay.rename(tmp_path / "moved")
    overlay.symlink_to(repo / "overlay")
    with pytest.raises(ValueError, match="symlink"):
        podman.job_scratch(labels)
    overlay.unlink()
    (tmp_path / "moved").rename(overlay)
    assert podman.job_scratch(labels) == scratch

    link = tmp_path / "q-link"
    link.symlink_to(root)
    for bad, why in (
        ({"fila.root": str(link)}, "symlinks"),
        ({"fila.root": "q"}, "absolute"),
        ({"fila.root": f"{root}/../q"}, "symlinks"),
        ({"fila.job": "../../x"}, "job id"),
    ):
        with pytest.raises(ValueError, match=why):
            podman.job_scratch({**labels, **bad})
    os.chown(root / "sandbox" / "meta", OTHER, OTHER)  # another user's directory on the way
    with pytest.raises(ValueError, match=f"uid {OTHER}"):
        podman.job_scratch(labels)
    os.chown(root / "sandbox" / "meta", 0, 0)
    assert podman.job_scratch(labels) == scratch


def _as(user: str, python: str, code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by `user` as the tests' driver runs fila: env -i, no XDG_RUNTIME_DIR, so the
    runtime directory is /tmp/podman-run-$UID, which any local user could have made first."""
    from tests.support.users import as_user, podman_env

    argv = [*as_user(user, podman_env(user)), python, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/")


_PING = (
    "from fila.sandbox.podman.backend import PodmanBackend\n"
    "from fila.core.errors import EngineUnavailable\n"
    "b = PodmanBackend()\n"
    "try:\n"
    "    b.ping()\n"
    "except EngineUnavailable as e:\n"
    "    print('REFUSED', e, '|', e.hint)\n"
    "else:\n"
    "    print('ROOTLESS', b.info()['host']['security']['rootless'], b.socket)\n"
)


@pytest.mark.slow
def test_another_local_users_podman_run_directory_is_refused_and_the_users_own_is_used() -> None:
    """Two throwaway users: the attacker makes the victim's /tmp/podman-run-$UID first (0777, with
    a link where fila writes its config); the victim's fila refuses it, naming it and its owner, and
    writes nothing through the link. Once it is gone, fila makes its own and real rootless Podman
    answers there (the counterpart)."""
    from tests.support.users import podman_user, python_for_others

    python = python_for_others()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} an ordinary user may run")
    with podman_user() as victim, podman_user() as attacker:
        vuid, auid = pwd.getpwnam(victim).pw_uid, pwd.getpwnam(attacker).pw_uid
        precious = Path(pwd.getpwnam(victim).pw_dir) / "precious.txt"
        precious.write_text("victim precious data\n")
        os.chown(precious, vuid, vuid)
        run = Path(f"/tmp/podman-run-{vuid}")
        plant = (
            f"umask 000; mkdir -p {run}/podman && chmod 777 {run} {run}/podman && "
            f"ln -s {precious} {run}/podman/fila-containers.conf"
        )
        subprocess.run(["runuser", "-u", attacker, "--", "sh", "-c", plant], check=True)
        assert run.lstat().st_uid == auid

        res = _as(victim, python, _PING)
        assert precious.read_text() == "victim precious data\n"  # not written through the link
        assert res.stdout.startswith("REFUSED"), res.stdout + res.stderr
        assert str(run) in res.stdout and f"uid {auid} ({attacker})" in res.stdout and "0777" in res.stdout
        assert "XDG_RUNTIME_DIR" in res.stdout  # what to do
        assert not (run / "podman" / "podman.sock").exists()  # no service was started there

        shutil.rmtree(run)  # what the hint says: its owner (or root) removes it
        res = _as(victim, python, _PING)
        assert res.stdout.startswith(f"ROOTLESS True {run}/podman/podman.sock"), res.stdout + res.stderr
        st = run.lstat()
        assert st.st_uid == vuid and not st.st_mode & 0o022
        assert precious.read_text() == "victim precious data\n"

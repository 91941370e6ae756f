"""The teardown a one-shot process hands over: its jobs' gateways, namespace holders and job
networks removed by a detached process after it exits (`fila submit --run`, `fila run --once`),
so that a CI job's step ends once the record is written rather than a third of a second later
(docs/benchmarks.md, "The one-shot path").

What is handed over holds nothing of a job's any more: the engine's container is gone and the
gateway, killed at the engine's exit (egress.halt), had its log read and its directory (its
secrets) removed before the record was published. The reaper holds a lock
file (`reap-<token>.lock` in the spares directory) from before the handing process exits until
all is gone, then removes it, and it inherits the spares' own locks, so that a recovery pass
leaves them to it while it lives; a reaper that dies leaves every lock free and the rest to
`fila recover`, which finds the containers and networks by their labels. Its output (what it could not
remove, or a traceback) goes to `reap-<token>.log` beside its lock, which recovery reports and
removes (sandbox/gateways.reapers_said); a reaper with nothing to say removes it.

    python -I -c START FD LOCK_PATH SYS_PATH_JSON < items.json
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, NotFound

from ...core.fsutil import HeldLock, held_new_lock_fd
from ...egress.config import Gateway, remove_dir
from ..gateways import REAPER_LOCK, forget
from .client import socket_path
from .removal import SETTLE_S, remove_in_turn


def items(gateways: list[Gateway], directory: Path) -> list[dict[str, Any]]:
    """What the reaper removes of each gateway: its containers, job network, its directory when
    it is a spare's not yet taken (a job's gateway directory is the job's, removed before its
    record: a later attempt of the task may use that path), and a spare's lock and directory."""
    return [
        {
            "containers": [gw.container] + ([gw.netns] if gw.netns else []),
            "leaving": not gw.stopped,  # a spare never taken still runs (removal.py)
            "network": gw.network,
            "dirs": [str(gw.dir)] if not gw.dir_gone and gw.dir.parent == directory else [],
            "spare": gw.spare,
            "spares_dir": str(directory),
        }
        for gw in gateways
    ]


# The reaper's interpreter: isolated (no PYTHON* variable, no user site, no working directory on
# sys.path, run from /, an empty environment: the caller's may hold a route's credential, which
# only the gateway is to hold), its sys.path the caller's own without the caller's script
# directory or working directory (`import_path`): the same fila and libraries, in the same order.
START = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[3]); "
    "from fila.sandbox.docker.reap import main; sys.exit(main())"
)


def import_path() -> list[str]:
    """This process's sys.path as the reaper is to have it: without the entry the interpreter put
    first (the script's directory, or the working directory for `-m` and `-c`) and anything
    relative."""
    paths = sys.path if sys.flags.safe_path else sys.path[1:]
    return [p for p in paths if p and os.path.isabs(p) and p != os.getcwd()]


def handoff(client: docker.DockerClient, gateways: list[Gateway], directory: Path) -> bool:
    """Start the detached reaper for `gateways` and return at once: True. False when the
    daemon is not reached by a Unix socket (a TCP, TLS or SSH context the reaper would have to
    resolve again: the caller removes them itself). OSError when the reaper cannot be started
    (likewise)."""
    path = socket_path(client)
    if path is None:
        return False
    doc = {
        "base_url": f"unix://{path}",
        "version": client.api.api_version,
        "items": items(gateways, directory),
    }
    lock = directory / f"{REAPER_LOCK}{secrets.token_hex(6)}.lock"
    # The spares' own locks go with them: recovery leaves a spare alone while its reaper lives.
    spare_locks = [gw.released for gw in gateways if isinstance(gw.released, HeldLock)]
    dups: list[int] = []
    fd = log = -1
    try:
        dups = [d for held in spare_locks if (d := held.dup()) is not None]
        fd = held_new_lock_fd(lock)
        # Its output, a traceback included, goes to its log beside its lock, which recovery
        # reports (gateways.reapers_said).
        log = os.open(lock.with_suffix(".log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", START, str(fd), str(lock), json.dumps(import_path())],
            stdin=subprocess.PIPE,
            # Never the caller's streams: a CI step waits for them to close, not only for its
            # process to exit.
            stdout=log,
            stderr=log,
            pass_fds=(fd, *dups),
            start_new_session=True,  # a Ctrl-C or SIGHUP to the caller's group is not the reaper's
            close_fds=True,
            cwd="/",
            env={},
        )
    except BaseException:
        if fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
        raise
    finally:
        for d in (*dups, fd, log):
            if d >= 0:
                os.close(d)
    for held in spare_locks:  # the reaper holds them now, and its own
        held.hand_over()
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(json.dumps(doc).encode())
    with contextlib.suppress(OSError):
        proc.stdin.close()
    return True


def remove_network(client: docker.DockerClient, name: str, deadline: float) -> None:
    """Remove `name` once its endpoints are gone (a container being removed is still on it)."""
    while True:
        try:
            client.api.remove_network(name)
            return
        except NotFound:
            return
        except APIError as e:
            if time.monotonic() > deadline:
                raise
            if e.status_code not in (403, 409, 500):
                raise
            time.sleep(0.1)


def reap(client: docker.DockerClient, todo: list[dict[str, Any]]) -> list[str]:
    """Remove every item's containers (one after the other, each gone before the next: a
    removal the handing process started is waited out; sandbox/docker/removal.py says why), then
    its network, directories and spare lock; what could not be removed, described."""
    errors: list[str] = []
    deadline = time.monotonic() + SETTLE_S
    for item in todo:
        leaving = bool(item.get("leaving", True))
        errors += remove_in_turn(client, [str(n) for n in item["containers"]], deadline, leaving=leaving)
        try:
            remove_network(client, str(item["network"]), deadline)
        except Exception as e:
            errors.append(f"network {item['network']}: {e}")
            continue  # its spare's lock and directory stay: recovery finds it unowned
        for d in item.get("dirs") or []:
            try:
                remove_dir(Path(d))
            except OSError as e:
                errors.append(f"{d}: {e}")
        if item.get("spare"):
            try:
                forget(Path(item["spares_dir"]), str(item["spare"]))
            except OSError as e:
                errors.append(f"spare {item['spare']}: {e}")
    return errors


def main(argv: list[str] | None = None) -> int:
    """The reaper: argv FD LOCK (its lock's descriptor and path), the items on stdin; what it
    could not remove is written to its stderr (its log), one line each."""
    args = sys.argv[1:] if argv is None else argv
    fd, lock = int(args[0]), Path(args[1])
    errors: list[str] = []
    try:
        doc = json.loads(sys.stdin.buffer.read())
        client = docker.DockerClient(base_url=doc["base_url"], version=doc["version"], timeout=60)
        try:
            errors = reap(client, doc["items"])
        finally:
            client.close()
    except Exception as e:  # said in the log; recovery removes what is left
        errors.append(f"the reaper failed: {e}")
    finally:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for line in errors:
            print(f"{stamp} {line}; `fila recover` removes it", file=sys.stderr, flush=True)
        if not errors:  # nothing to say: its log goes (a traceback stays for recovery to say)
            with contextlib.suppress(OSError):
                if lock.with_suffix(".log").stat().st_size == 0:
                    lock.with_suffix(".log").unlink()
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

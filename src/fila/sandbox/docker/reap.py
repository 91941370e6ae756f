"""The teardown a one-shot process hands over: its jobs' gateways, namespace holders and job
networks removed by a detached process after it exits (`fila submit --run`, `fila run --once`),
so that a CI job's step ends once the record is written rather than a third of a second later
(docs/benchmarks.md, "The one-shot path").

What is handed over holds nothing of a job's any more: the engine's container is gone and the
gateway's directory (its secrets and log) removed before the record was published; a gateway
not serving was killed (egress.halt) and one serving has no client left. The reaper holds a lock
file (`reap-<token>.lock` in the spares directory) from before the handing process exits until
all is gone, then removes it, and it inherits the spares' own locks, so that a recovery pass
leaves them to it while it lives; a reaper that dies leaves every lock free and the rest to
`fila recover`, which finds the containers and networks by their labels. What it could not remove is
appended to `reap.log` beside the lock.

    python -m fila.sandbox.docker.reap FD LOCK_PATH < items.json
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, NotFound

from ...core.fsutil import HeldLock, held_new_lock_fd
from ...egress.config import Gateway, remove_dir
from ..gateways import REAPER_LOCK, forget

# How long a removal another client started, or a network's last endpoint, is waited for.
SETTLE_S = 60.0
LOG_NAME = "reap.log"


def items(gateways: list[Gateway], directory: Path) -> list[dict[str, Any]]:
    """What the reaper removes of each gateway: its containers, job network, directory (unless
    removed already) and, for a spare, its lock and directory in `directory`."""
    return [
        {
            "containers": [gw.container] + ([gw.netns] if gw.netns else []),
            "network": gw.network,
            "dirs": [] if gw.dir_gone else [str(gw.dir)],
            "spare": gw.spare,
            "spares_dir": str(directory),
        }
        for gw in gateways
    ]


def handoff(client: docker.DockerClient, gateways: list[Gateway], directory: Path) -> None:
    """Start the detached reaper for `gateways` (of the daemon `client` speaks to) and return at
    once. OSError when it cannot be started (the caller then removes them itself)."""
    adapter = client.api.get_adapter(client.api.base_url)
    socket_path = getattr(adapter, "socket_path", None)
    doc = {
        "base_url": f"unix://{socket_path}" if socket_path else None,
        "version": client.api.api_version,
        "items": items(gateways, directory),
    }
    lock = directory / f"{REAPER_LOCK}{secrets.token_hex(6)}.lock"
    # The spares' own locks go with them: recovery leaves a spare alone while its reaper lives.
    spare_locks = [
        gw.released.fd for gw in gateways if isinstance(gw.released, HeldLock) and gw.released.held
    ]
    fd = held_new_lock_fd(lock)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fila.sandbox.docker.reap", str(fd), str(lock)],
            stdin=subprocess.PIPE,
            # Never the caller's streams: a CI step waits for them to close, not only for its
            # process to exit.
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(fd, *spare_locks),
            start_new_session=True,  # a Ctrl-C or SIGHUP to the caller's group is not the reaper's
            close_fds=True,
        )
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)
        raise
    os.close(fd)  # the reaper holds the lock now
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(json.dumps(doc).encode())
    with contextlib.suppress(OSError):
        proc.stdin.close()


def busy(directory: Path) -> list[Path]:
    """The locks of reapers still at work in `directory` (held by a live process)."""
    from ...core.fsutil import lock_held

    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return [p for p in sorted(directory.glob(f"{REAPER_LOCK}*.lock")) if lock_held(p)]
    return []


def remove_container(client: docker.DockerClient, name: str, deadline: float) -> None:
    """Force-remove `name`; a removal in progress elsewhere (the handing process's last request)
    is waited out."""
    while True:
        try:
            client.api.remove_container(name, force=True, v=True)
            return
        except NotFound:
            return
        except APIError as e:
            if e.status_code != 409 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


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
    """Remove every item's containers (side by side), then its network, directories and spare
    lock; what could not be removed, described."""
    errors: list[str] = []
    deadline = time.monotonic() + SETTLE_S

    def container(name: str) -> None:
        try:
            remove_container(client, name, deadline)
        except Exception as e:
            errors.append(f"container {name}: {e}")

    for item in todo:
        boxes = [threading.Thread(target=container, args=(str(n),), daemon=True) for n in item["containers"]]
        for t in boxes:
            t.start()
        for t in boxes:
            t.join()
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
    args = sys.argv[1:] if argv is None else argv
    fd, lock = int(args[0]), Path(args[1])
    errors: list[str] = []
    try:
        doc = json.loads(sys.stdin.buffer.read())
        client = (
            docker.DockerClient(base_url=doc["base_url"], version=doc["version"], timeout=60)
            if doc.get("base_url")
            else docker.from_env(version=doc["version"], timeout=60)
        )
        try:
            errors = reap(client, doc["items"])
        finally:
            client.close()
    except Exception as e:  # said in the log; recovery removes what is left
        errors.append(f"the reaper failed: {e}")
    finally:
        if errors:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with contextlib.suppress(OSError), open(lock.parent / LOG_NAME, "a") as log:
                for line in errors:
                    log.write(f"{stamp} {line}; `fila recover` removes it\n")
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

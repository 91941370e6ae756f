"""A job network's bridge closed to the host itself (docs/environments.md, "A project
Dockerfile").

A project Dockerfile's RUN steps run in the classic builder's containers, whose capabilities fila
cannot set: they keep Docker's default NET_RAW. With it a step writes raw frames on its job
network's bridge and so reaches the host's own addresses through it (the bridge's IPv6 link-local
address both ways; any host address one way), past the internal network's routing, which only
binds ordinary sockets. fila's jobs and setups never have NET_RAW; a build's gateway network is
the one place it meets a bridge, so there the host drops, for that bridge, every packet addressed
to the host (iptables and ip6tables INPUT rules, inserted before the build, deleted after it;
traffic between the build and its gateway is bridged, never the host's INPUT). Only a root
process beside a local daemon can do it: elsewhere `refusal` says why and the build gets no network.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import docker

from ...core.errors import InfraError
from .container import measured

TOOLS = ("iptables", "ip6tables")
COMMENT_PREFIX = "fila-build-seal"


def bridge_of(client: docker.DockerClient, network: str) -> str:
    """The Linux bridge behind the Docker network `network` (its driver's own name, or br-<id>)."""
    attrs = client.api.inspect_network(network)
    return (attrs.get("Options") or {}).get("com.docker.network.bridge.name") or f"br-{attrs['Id'][:12]}"


def refusal(client: docker.DockerClient) -> str | None:
    """Why this process cannot close a bridge to the host (None: it can): it is not root, the
    firewall tools are missing, or the daemon is not on this host's network stack."""
    if os.geteuid() != 0:
        return "closing the build's bridge to the host needs root (iptables)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"closing the build's bridge to the host needs {' and '.join(missing)}"
    base = str(getattr(client.api, "base_url", ""))
    if base != "http+docker://localhost":  # the SDK's name for a unix socket; tcp and ssh are remote
        return f"the Docker daemon is not on this host ({base}): its bridges are not this host's"
    return None


@contextlib.contextmanager
def sealed(bridge: str, label: str) -> Iterator[None]:
    """The host deaf to `bridge` for the block: a DROP rule in INPUT for each address family,
    tagged with `label` (the build's job id) so a crash's leftovers are found and removed
    (`remove_stale`). InfraError when the bridge is not on this host or a rule cannot be set."""
    if not Path("/sys/class/net", bridge).exists():
        raise InfraError(f"the build's bridge {bridge} is not on this host's network stack")
    rule = _rule(bridge, f"{COMMENT_PREFIX}:{label}")
    done: list[str] = []
    try:
        for tool in TOOLS:
            _run(tool, "-I", *rule)
            done.append(tool)
        yield
    finally:
        for tool in done:
            _run(tool, "-D", *rule, check=False)


def remove_stale() -> list[str]:
    """Delete the seal rules whose bridge is gone (a build killed before it could delete its own);
    returns what was removed, described."""
    if os.geteuid() != 0:
        return []
    present = set(os.listdir("/sys/class/net"))
    removed = []
    for tool in TOOLS:
        if shutil.which(tool) is None:
            continue
        for line in _run(tool, "-S", "INPUT", check=False).splitlines():
            parts = line.split()
            if parts[:2] != ["-A", "INPUT"] or "--comment" not in parts or "-i" not in parts:
                continue
            comment = parts[parts.index("--comment") + 1].strip('"')
            bridge = parts[parts.index("-i") + 1]
            if comment.startswith(COMMENT_PREFIX + ":") and bridge not in present:
                _run(tool, "-D", *_rule(bridge, comment), check=False)
                removed.append(f"{tool} rule for the gone bridge {bridge}")
    return removed


def _rule(bridge: str, comment: str) -> list[str]:
    return ["INPUT", "-i", bridge, "-m", "comment", "--comment", comment, "-j", "DROP"]


def _run(tool: str, *args: str, check: bool = True) -> str:
    try:
        done = subprocess.run(
            [tool, "-w", "5", *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise InfraError(f"{tool} {' '.join(args[:2])} failed: {e}") from None
        return ""
    if check and done.returncode != 0:
        raise InfraError(
            f"{tool} {' '.join(args[:3])} failed ({done.returncode}): {done.stderr.strip()[:300]}",
            hint="a project Dockerfile's build needs its bridge closed to the host; check the firewall",
        )
    return done.stdout


PIDS_ROOT = Path("/sys/fs/cgroup/pids")


def pids_refusal() -> str | None:
    """Why a build's RUN steps cannot get a pids limit here (None: they can): the limit is a
    cgroup fila makes as their parent, on cgroup v1's pids hierarchy (the cgroupfs driver)."""
    if os.geteuid() != 0:
        return "a pids limit on the build's RUN steps needs root (a cgroup of fila's)"
    if not (PIDS_ROOT / "pids.max").exists() and not (PIDS_ROOT / "cgroup.procs").exists():
        return "a pids limit on the build's RUN steps needs cgroup v1's pids hierarchy"
    return None


def cgroup_name(root: Path, job_id: str) -> str:
    """A build's cgroup's name: this root's (a digest of its path: cgroups are the host's, shared
    by every root), the job's id, and a part of its own."""
    import secrets

    return f"{_cgroup_prefix(root)}{job_id}-{secrets.token_hex(3)}"


def _cgroup_prefix(root: Path) -> str:
    import hashlib

    return f"fila-build-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}-"


def remove_stale_cgroups(root: Path, alive: Callable[[str], bool]) -> list[str]:
    """Remove this root's build cgroups whose job is not `alive` (a build killed before it could
    remove its own; another root's are left to it); returns what was removed, described."""
    prefix = _cgroup_prefix(root)
    removed = []
    for path in PIDS_ROOT.glob(prefix + "*") if PIDS_ROOT.is_dir() else []:
        job = path.name[len(prefix) :].rpartition("-")[0]
        if job and not alive(job):
            remove_cgroup(path.name)
            if not path.exists():
                removed.append(f"cgroup {path}")
    return removed


@contextlib.contextmanager
def pids_parent(name: str, pids: int) -> Iterator[str]:
    """A cgroup allowing `pids` processes in all, made for one build (`name`: cgroup_name): its
    path (the build's `cgroupparent`: each RUN step's container is made under it, so together
    they stay under the limit, a fork bomb among them included). Removed after the build, once
    its steps are gone; a killed build's by `remove_stale_cgroups`."""
    path = PIDS_ROOT / name
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(pids))
    except OSError as e:
        with contextlib.suppress(OSError):
            path.rmdir()
        raise InfraError(f"cannot make the build's pids cgroup {path}: {e.strerror or e}") from None
    try:
        yield f"/{path.name}"
    finally:
        remove_cgroup(path.name)


def remove_cgroup(name: str) -> None:
    """The build's cgroup `name` in every hierarchy: the daemon makes it under each controller
    (memory, cpu, blkio...) for the steps' containers, fila only under pids."""
    hierarchies = PIDS_ROOT.parent
    for hierarchy in hierarchies.iterdir() if hierarchies.is_dir() else []:
        if (hierarchy / name).is_dir():
            _remove_cgroup(hierarchy / name)


def _remove_cgroup(path: Path) -> None:
    """`path` and what the daemon made under it (each step's cgroup, gone with its container; the
    daemon may lag a moment)."""
    import time

    for _ in range(50):
        try:
            for child in sorted(path.iterdir(), reverse=True):
                if child.is_dir():
                    child.rmdir()
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


class SizeWatch:
    """What a build's RUN steps write, measured while they run (each step's container is found by
    its cgroup under the build's parent, `pids_parent`, and measured by the daemon): a step past
    `max_bytes` is killed, so the build fails, and `exceeded` says why. Measured every
    `period_s` on a connection of its own, until `stop`."""

    def __init__(
        self, client: docker.DockerClient, parent: str, max_bytes: int, period_s: float = 1.0
    ) -> None:
        import threading

        self.client, self.path, self.max_bytes, self.period_s = (
            client,
            PIDS_ROOT / parent.lstrip("/"),
            max_bytes,
            period_s,
        )
        self.exceeded: str | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="fila-build-size", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stopped.wait(self.period_s):
            with contextlib.suppress(OSError, docker.errors.DockerException):
                for cid in [p.name for p in self.path.iterdir() if p.is_dir()]:
                    # The image the step runs on and what it wrote: the image it would leave.
                    size = measured(self.client, cid, "SizeRootFs")
                    if size > self.max_bytes:
                        limit = f"environment.max_image_bytes {self.max_bytes}"
                        self.exceeded = f"a RUN step made its image {size} bytes, over {limit}"
                        self.client.api.kill(cid)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)

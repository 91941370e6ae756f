"""The job container's request: the policy's hardening and limits mapped, in one pure function
(`create_kwargs`), to what the Docker API creates (docs/architecture.md, "Threat model in brief").

The mounts are the job's Workspace's (core/mounts.py): a bind per directory it names, and the
overlay strategy's work/ as a volume the daemon mounts.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from docker.types import DriverConfig, LogConfig, Mount, Ulimit

from ...core.errors import InfraError, InvalidPolicy
from ...core.models import Limits, Policy, parse_size
from ...core.mounts import Bind, OverlayVolume
from ...engines.base import HOME, JOB_MOUNT
from ..base import JOB_LABEL, LABEL, SETUP_CAPS, RunSpec, run_as

if TYPE_CHECKING:
    from ...egress.config import Gateway


def _effective(policy: Policy, limits: Limits | None) -> tuple[int, float, int]:
    """memory bytes, cpus, pids. The caller checked limits <= policy; min() keeps that true anyway."""
    mem, cpus, pids = parse_size(policy.memory), policy.cpus, policy.pids
    if limits is not None:
        mem = min(mem, parse_size(limits.memory)) if limits.memory is not None else mem
        cpus = min(cpus, limits.cpus) if limits.cpus is not None else cpus
        pids = min(pids, limits.pids) if limits.pids is not None else pids
    return mem, cpus, pids


def _check_limits(kw: dict[str, Any], policy: Policy) -> None:
    """The last look at what reaches Docker: every limit > 0 (0 and -1 read as "unlimited") and
    within the policy, whatever the models let through. A policy is input too."""
    from ...core.models import MIN_CPUS, MIN_MEMORY, MIN_PIDS, MIN_SIZE

    mem = parse_size(policy.memory)
    fsize = parse_size(policy.fsize)
    tmp_caps = {"/tmp": parse_size(policy.tmpfs.tmp), HOME: parse_size(policy.tmpfs.home)}
    tmpfs = []  # a tmpfs without size= gets half the host's memory: refused like size=0
    for target, opts in kw.get("tmpfs", {}).items():
        size = re.search(r"(?:^|,)size=([0-9]+)(?:,|$)", opts)
        cap = tmp_caps.get(target, max(tmp_caps.values()))
        tmpfs.append((f"tmpfs {target}", int(size.group(1)) if size else None, MIN_SIZE, cap))
    checks = [
        ("memory", kw["mem_limit"], MIN_MEMORY, mem),
        ("memory swap", kw["memswap_limit"], MIN_MEMORY, mem),
        ("cpus", kw["nano_cpus"], int(MIN_CPUS * 1e9), int(policy.cpus * 1e9)),
        ("pids", kw["pids_limit"], MIN_PIDS, policy.pids),
        *((f"ulimit {u['Name']}", u["Hard"], 1, policy.nofile if u["Name"] == "nofile" else fsize)
          for u in kw["ulimits"]),
        *((f"ulimit {u['Name']} (soft)", u["Soft"], 1, u["Hard"]) for u in kw["ulimits"]),
        *tmpfs,
    ]  # fmt: skip
    for what, value, floor, cap in checks:
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 < floor <= value <= cap):
            raise InvalidPolicy(
                f"container {what} would be {value!r}: allowed {floor} to {cap}",
                hint="fix the policy or the task's limits: 0 and tiny values mean no limit to Docker",
            )


def create_kwargs(spec: RunSpec, name: str, gateway: Gateway | None = None) -> dict[str, Any]:
    """Everything the container is created with. The image controls none of the entrypoint,
    command, user or workdir (runc CVE-2024-21626 was a workdir trick); its ENV only fills the
    names `spec.env` leaves unset, and never comes from the host."""
    if not spec.argv:
        raise ValueError("RunSpec.argv is empty")
    job_dir = spec.job_dir.resolve()
    input_dir, work_dir = job_dir / "input", job_dir / "work"
    if not job_dir.is_dir():
        raise InfraError("the job directory is missing", task_id=spec.job_id, path=job_dir)
    for sub in (input_dir, work_dir):
        if sub.is_symlink() or not sub.is_dir():
            raise InfraError(f"the job's {sub.name}/ is not a directory", task_id=spec.job_id, path=sub)
    p = spec.policy
    mem, cpus, pids = _effective(p, spec.limits)
    uid, gid = (0, 0) if spec.setup is not None else run_as()
    fsize = parse_size(p.fsize)
    # exec: engines run tools from /tmp and HOME (npm, pip builds); the work/ bind allows it anyway.
    tmp_opts = f"rw,nosuid,nodev,exec,size={parse_size(p.tmpfs.tmp)},mode=1777"
    home_opts = f"rw,nosuid,nodev,exec,size={parse_size(p.tmpfs.home)},uid={uid},gid={gid},mode=0700"
    # The daemon keeps its own copy of the output; capped so a log bomb cannot fill its disk.
    daemon_log = str(max(2 * p.max_log_bytes, 1 << 20))
    kwargs: dict[str, Any] = dict(
        image=spec.image,
        name=name,
        entrypoint=spec.argv[:1],
        command=spec.argv[1:],
        environment={**spec.env, "HOME": HOME},
        working_dir=JOB_MOUNT,
        user=f"{uid}:{gid}",
        hostname="fila",
        labels={**spec.labels, LABEL: "1", JOB_LABEL: spec.job_id}
        | ({VOLUME_LABEL: work_volume(name)} if has_volume(spec) else {}),
        # Only work/ is writable, whoever the engine runs as: with the host user's uid (fila not
        # run as root) the engine owns the job directory, and only the mount keeps it from
        # rewriting TASK.md or leaving files beside work/ (the host would read them later).
        # The overlay strategy's input/ is the shared snapshot; its work/ an overlay volume the
        # daemon mounts (its upper layer alone takes writes).
        mounts=[_mount(m, spec, name) for m in spec.workspace.mounts(JOB_MOUNT)],
        network_mode=p.network if p.network != "allowlist" else "none",
        mem_limit=mem,
        memswap_limit=mem,
        nano_cpus=int(cpus * 1e9),
        pids_limit=pids,
        ulimits=[
            Ulimit(name="nofile", soft=p.nofile, hard=p.nofile),
            Ulimit(name="fsize", soft=fsize, hard=fsize),
        ],
        read_only=True,
        tmpfs={"/tmp": tmp_opts, HOME: home_opts},
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        privileged=False,
        init=True,
        ipc_mode="private",
        oom_score_adj=500,  # under host-wide memory pressure the engine dies before the host's
        stop_signal="SIGTERM",
        log_config=LogConfig(type=LogConfig.types.JSON, config={"max-size": daemon_log, "max-file": "3"}),
        stdin_open=False,
        tty=False,
    )
    for v in spec.volumes:  # after work/: mounted over it, read-only
        kwargs["mounts"].append(Mount(v.target, v.name, type="volume", read_only=True, no_copy=True))
    if spec.setup is not None:
        # docs/environments.md, "The setup": root for the package managers, its root file system
        # writable (committed after), the capabilities they need and no other.
        kwargs.update(read_only=False, cap_add=list(SETUP_CAPS))
    if p.runtime:
        kwargs["runtime"] = docker_runtime(p)
    if p.network == "allowlist" and gateway is not None:  # without one: no network at all
        # The job network only: the gateway is the engine's proxy, resolver and model routes.
        if gateway.netns is not None and not p.runtime:
            # The namespace its holder has on the job network (its resolver is the gateway too):
            # joined, not made at the start. Not with another runtime (gVisor's netstack).
            kwargs["network_mode"] = f"container:{gateway.netns}"
            del kwargs["hostname"]  # the holder's ("fila"): Docker refuses one with this mode
        else:
            kwargs["network_mode"] = gateway.network
            kwargs["dns"] = [gateway.ip]
        # The gateway's values win: a real key forwarded by an adapter never replaces the placeholder.
        kwargs["environment"] = {**kwargs["environment"], **gateway.engine_env()}
    _check_limits(kwargs, p)
    return kwargs


def docker_runtime(policy: Policy) -> str:
    """The Docker runtime of a policy. gVisor is registered twice (scripts/docker-up): `runsc`
    with --network=none, and `runsc-hostinet` whose gVisor uses the container's own network
    namespace (the job network), since its netstack cannot start on this kind of host."""
    if policy.runtime == "runsc" and policy.network != "none":
        return "runsc-hostinet"
    return str(policy.runtime)


VOLUME_LABEL = "fila.volume"  # on a container whose work/ is an overlay volume: the volume's name


def work_volume(container: str) -> str:
    return f"{container}-work"


def has_volume(spec: RunSpec) -> bool:
    """The job's work/ is an overlay volume (the overlay strategy), removed with its container."""
    return any(isinstance(m, OverlayVolume) for m in spec.workspace.mounts(JOB_MOUNT))


def _mount(m: Bind | OverlayVolume, spec: RunSpec, name: str) -> Mount:
    """A Workspace mount as Docker's. An overlay is a `local` volume of type overlay, made by the
    daemon with the container (one request: no volume without its container) and mounted by it,
    so fila needs no mount privilege (OverlayVolume.options says which overlay options and why).
    no_copy: nothing of the image is copied into it."""
    if isinstance(m, Bind):
        return Mount(m.target, str(m.source), type="bind", read_only=m.read_only)
    return Mount(
        m.target,
        work_volume(name),
        type="volume",
        read_only=False,
        no_copy=True,
        labels={**spec.labels, LABEL: "1", JOB_LABEL: spec.job_id},
        driver_config=DriverConfig(
            "local", options={"type": "overlay", "device": "overlay", "o": m.options()}
        ),
    )

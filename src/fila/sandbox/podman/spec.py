"""create_kwargs' request as Podman's own (`/libpod/containers/create`), in one pure function
(docs/architecture.md, "Threat model in brief").

The Docker-compatible endpoint ignores ulimits in rootless mode (podman#25881, fixed in 5.5; Debian
12 has 4.3) and cannot ask for `userns=keep-id`, which rootless Podman needs so that the engine runs
with the user's own uid and can write work/. `libpod_spec` refuses any key it does not know, so a
new hardening flag cannot be dropped here in silence.
"""

from __future__ import annotations

from typing import Any

_SIGNALS = {"SIGTERM": 15, "SIGKILL": 9, "SIGINT": 2}
_LIMIT_KEYS = {"mem_limit": "memory", "memswap_limit": "memory", "nano_cpus": "cpus", "pids_limit": "pids"}
# The overlay options create_kwargs' work/ volume carries, and what Podman's own overlay volume
# (`-v LOWER:DST:O,upperdir=U,workdir=W`) makes of them: Podman adds `userxattr` itself when it
# mounts rootless (seen in the container's mountinfo: `redirect_dir=nofollow,uuid=on,userxattr`).
_OVERLAY_OPTS = ("lowerdir", "upperdir", "workdir")


def _overlay_volume(m: Any) -> dict[str, Any]:
    """The overlay strategy's work/ (a Docker `local` volume of type overlay) as libpod's
    `overlay_volumes` entry: the snapshot is its lower layer, the job's upper and scratch
    directories are given, so the host reads the upper layer after the container is gone."""
    vo = m.get("VolumeOptions") or {}
    dc = vo.get("DriverConfig") or {}
    opts = dict(dc.get("Options") or {})
    kind = (dc.get("Name"), opts.pop("type", None), opts.pop("device", None))
    if kind != ("local", "overlay", "overlay"):
        raise ValueError(f"libpod_spec: volume {m.get('Source')!r} is not an overlay of the local driver")
    given = str(opts.pop("o", ""))
    if opts:
        raise ValueError(f"libpod_spec: overlay volume options {sorted(opts)} are not mapped")
    fields: dict[str, str] = {}
    for o in given.split(","):
        k, _, v = o.partition("=")
        if k == "userxattr" and not v:
            continue
        if k not in _OVERLAY_OPTS or not v or k in fields:
            raise ValueError(f"libpod_spec: overlay mount option {o!r} is not mapped")
        fields[k] = v
    if sorted(fields) != sorted(_OVERLAY_OPTS) or m.get("ReadOnly"):
        raise ValueError("libpod_spec: an overlay work/ needs lowerdir, upperdir and workdir, read-write")
    return {
        "destination": m["Target"],
        "source": fields["lowerdir"],
        "options": [f"upperdir={fields['upperdir']}", f"workdir={fields['workdir']}"],
    }


def _mount(m: Any) -> dict[str, Any]:
    if m.get("Type") != "bind":
        raise ValueError(f"libpod_spec: mount type {m.get('Type')!r} is not mapped")
    return {
        "destination": m["Target"],
        "source": m["Source"],
        "type": "bind",
        "options": ["rbind", "ro" if m.get("ReadOnly") else "rw"],
    }


def _tmpfs(target: str, opts: str) -> dict[str, Any]:
    out = []
    for o in opts.split(","):
        # Podman has no uid=/gid= for a tmpfs: "U" makes it the container user's (keep-id: the
        # user fila runs as, the uid create_kwargs asked for).
        if o.startswith(("uid=", "gid=")):
            if "U" not in out:
                out.append("U")
            continue
        out.append(o)
    return {"destination": target, "type": "tmpfs", "source": "tmpfs", "options": out}


def libpod_spec(
    kwargs: dict[str, Any], *, rootless: bool, waive: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """create_kwargs' request as Podman's SpecGenerator. Limits named in `waive` are left out (the
    policy waived them and the host cannot enforce them); every other key must be mapped."""
    kw = dict(kwargs)
    spec: dict[str, Any] = {
        "image": kw.pop("image"),
        "name": kw.pop("name"),
        "entrypoint": list(kw.pop("entrypoint")),
        "command": list(kw.pop("command")),
        "env": dict(kw.pop("environment")),
        "work_dir": kw.pop("working_dir"),
        "user": kw.pop("user"),
        "hostname": kw.pop("hostname"),
        "labels": dict(kw.pop("labels")),
        "read_only_filesystem": bool(kw.pop("read_only")),
        "cap_drop": list(kw.pop("cap_drop")),
        "privileged": bool(kw.pop("privileged")),
        "init": bool(kw.pop("init")),
        "oom_score_adj": int(kw.pop("oom_score_adj")),
        "stop_signal": _SIGNALS[kw.pop("stop_signal")],
        "terminal": bool(kw.pop("tty")),
        "stdin": bool(kw.pop("stdin_open")),
        "r_limits": [{"type": u["Name"], "soft": u["Soft"], "hard": u["Hard"]} for u in kw.pop("ulimits")],
        "userns": {"nsmode": "keep-id"} if rootless else {"nsmode": "host"},
    }
    if kw.pop("ipc_mode") != "private":
        raise ValueError("libpod_spec: only a private IPC namespace is mapped")
    spec["ipcns"] = {"nsmode": "private"}
    sec = kw.pop("security_opt")
    if sec != ["no-new-privileges:true"]:
        raise ValueError(f"libpod_spec: security_opt {sec!r} is not mapped")
    spec["no_new_privileges"] = True
    all_mounts = kw.pop("mounts")
    mounts = [_mount(m) for m in all_mounts if m.get("Type") != "volume"]
    mounts += [_tmpfs(t, o) for t, o in kw.pop("tmpfs").items()]
    spec["mounts"] = mounts
    overlays = [_overlay_volume(m) for m in all_mounts if m.get("Type") == "volume"]
    if overlays:
        spec["overlay_volumes"] = overlays
    net = kw.pop("network_mode")
    if net == "none":
        spec["netns"] = {"nsmode": "none"}
    elif net == "bridge":
        spec["netns"] = {"nsmode": "slirp4netns" if rootless else "bridge"}
    elif net.startswith("fila-net-"):
        # network allowlist (podman_egress): the job network only, the gateway its only
        # resolver, and no IPv6 in the engine's namespace (no link-local path to the bridge).
        spec["netns"] = {"nsmode": "bridge"}
        spec["Networks"] = {net: {}}  # Podman 4.3's SpecGenerator spells this one with a capital N
        spec["dns_server"] = list(kw.pop("dns"))
        spec["sysctl"] = {"net.ipv6.conf.all.disable_ipv6": "1"}
    else:
        raise ValueError(f"libpod_spec: network {net!r} is not mapped")
    log = kw.pop("log_config")
    spec["log_configuration"] = {"driver": "k8s-file", "size": int(log["Config"]["max-size"])}
    limits: dict[str, Any] = {}
    mem, swap = kw.pop("mem_limit"), kw.pop("memswap_limit")
    cpus, pids = kw.pop("nano_cpus"), kw.pop("pids_limit")
    if "memory" not in waive:
        limits["memory"] = {"limit": mem, "swap": swap}
    if "cpus" not in waive:
        limits["cpu"] = {"quota": max(1000, cpus * 100_000 // 1_000_000_000), "period": 100_000}
    if "pids" not in waive:
        limits["pids"] = {"limit": pids}
    if limits:
        spec["resource_limits"] = limits
    if "runtime" in kw:
        spec["oci_runtime"] = kw.pop("runtime")
    if kw:
        raise ValueError(f"libpod_spec: create_kwargs keys not mapped to Podman: {sorted(kw)}")
    return spec

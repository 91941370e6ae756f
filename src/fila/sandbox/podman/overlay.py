"""The overlay strategy on rootless Podman (docs/architecture.md, "The Workspace seam"): whether
this host mounts a job's work/ as an overlay fila can read, and where a job's overlay scratch is,
from its container's labels, before anything in it is removed.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from ...core.layout import Root
from ...core.states import valid_id
from ..base import JOB_LABEL, ROOT_LABEL
from .service import not_own

# Measured on Podman 4.3 (Debian 12), kernel 6.18, rootless without a mount program: the upper
# layer takes deletions as character devices 0/0 and opaque directories as user.overlay.opaque,
# as overlay.Layers reads them; an older Podman was not measured.
MIN_OVERLAY_VERSION = (4, 3)


def overlay_why(info: dict[str, Any], release: str, filesystems: str) -> str | None:
    """Why this Podman cannot give a job's work/ as an overlay of its snapshot (None: it can),
    from `podman info`, the kernel release and /proc/filesystems. Rootless, Podman mounts an
    overlay volume with the kernel's overlay in the user namespace (5.11+), or with the storage's
    mount program (fuse-overlayfs) when one is configured: fila has not seen what that one writes
    for a deletion here, so its upper layer is not read, and the job copies its targets."""
    if "\toverlay\n" not in filesystems:
        return "this kernel has no overlay filesystem"
    raw = str((info.get("version") or {}).get("Version") or "")
    found = re.match(r"(\d+)\.(\d+)", raw)
    if found is None or (int(found[1]), int(found[2])) < MIN_OVERLAY_VERSION:
        want = ".".join(map(str, MIN_OVERLAY_VERSION))
        return f"podman {raw or '?'} is older than {want}, the version whose overlay volumes were measured"
    if not ((info.get("host") or {}).get("security") or {}).get("rootless"):
        # Root's Podman marks opaque directories with trusted.* xattrs and runs the engine without
        # keep-id: a different upper layer and ownership, not measured here.
        return "podman runs as root here: only rootless Podman's overlay volumes were measured"
    kernel = re.match(r"(\d+)\.(\d+)", release)
    if kernel is None or (int(kernel[1]), int(kernel[2])) < (5, 11):
        return (
            f"rootless podman on kernel {release} mounts overlay volumes with fuse-overlayfs (the "
            "kernel's overlay in a user namespace needs 5.11+), whose upper layer fila does not read"
        )
    graph = (info.get("store") or {}).get("graphOptions") or {}
    program = next((v for k, v in graph.items() if k.endswith("mount_program")), None)
    if program:
        exe = program.get("Executable") if isinstance(program, dict) else program
        return (
            f"podman's storage names a mount program ({exe}), which would mount the overlay: fila "
            "reads only the kernel overlay's upper layer (whiteouts as devices 0/0)"
        )
    return None


def job_scratch(labels: dict[str, str]) -> Path | None:
    """The overlay scratch directory a container's labels name (`<root>/sandbox/meta/<job>/overlay/
    work`), checked against fila's own job layout before anything in it is removed: the root an
    absolute path without a symlink in it, the job a job id, and every directory from the root
    down to the scratch a real directory of this user's. None when it is not there. A label is
    whatever the engine answers: one that does not pass raises ValueError naming why."""
    root, job = labels.get(ROOT_LABEL, ""), labels.get(JOB_LABEL, "")
    if not os.path.isabs(root) or os.path.realpath(root) != root:
        raise ValueError(f"its root label {root!r} is not an absolute path free of symlinks")
    if not valid_id(job):
        raise ValueError(f"its job label {job!r} is not a job id")
    scratch = Root(Path(root)).overlay_dir(job) / "work"
    here = Path(root)
    for part in ("", *scratch.relative_to(root).parts):
        here = here / part if part else here
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError(f"{here} {not_own(st, kind='dir')}")
    return scratch

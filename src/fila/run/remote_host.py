"""What a PostgreSQL runner's host can run (docs/scale-out.md, "Running it"): the engines whose
image its container engine has, and the policies of its root that it can run whole.
A runner claims only these, so a task it could not run waits for a runner that can, its tries
unspent, rather than fail here for this host's lack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import FilaError, HostLacks, InfraError
from ..core.layout import Root
from ..core.models import Task
from ..egress import config as egress
from ..engines import engine_names, get_engine
from ..queue.policy import load_policy, policy_names, policy_path
from ..sandbox.images import GATEWAY_IMAGE

if TYPE_CHECKING:
    from ..sandbox import Backend


def engines_here(backend: Backend) -> list[str]:
    """The engines whose image this host's container engine has."""
    out = []
    for name in engine_names():
        with contextlib.suppress(FilaError):
            if backend.image(get_engine(name).image_tag()) is not None:
                out.append(name)
    return out


def policy_lacks(root: Root, name: str, backend: Backend) -> str | None:
    """Why this host cannot run the tasks of policy `name` whole, or None: its file as `root` has
    it loads, its container runtime is here, and with `network: allowlist` the gateway's image is
    here and the credential of every route it names reads as the gateway reads it (set, not
    empty, UTF-8). Every route, not those one task's engines use: a task chooses its engines, and a
    policy this host could run only for some of them would let a task decide what the host lacks.
    The container engine not answering raises (InfraError)."""
    try:
        pol, _ = load_policy(root, name)
        want = backend.runtime_for(pol)
        if want is not None and want not in backend.runtimes():
            have = ", ".join(sorted(backend.runtimes()))
            return f"its runtime {want} is not in {backend.name} (it has: {have})"
        if pol.network == "allowlist":
            if backend.image(GATEWAY_IMAGE) is None:
                return f"{backend.name} has no image {GATEWAY_IMAGE} (network allowlist needs the gateway)"
            if pol.egress is not None:  # every credential set, and read as the gateway reads it
                egress.check_credentials(pol, list(pol.egress.routes), path=policy_path(root, name))
                egress.resolve_routes(pol)
    except InfraError:
        raise
    except FilaError as e:
        return f"{e}" + (f"; {e.hint}" if e.hint else "")
    return None


def usable_policies(root: Root, backend: Backend, progress: Callable[[str], None]) -> list[str]:
    """The policies a runner started without --policy claims: each of its root's (and fila's
    shipped ones it does not override) that this host can run whole (policy_lacks). One that it
    cannot is left out and said: a task of it stays queued for a runner that has it, never run
    here under another policy of its name, nor failed here for this host's lack."""
    out = []
    for name in policy_names(root):
        why = policy_lacks(root, name, backend)
        if why:
            progress(f"fila worker: policy {name} left out (its tasks wait for another runner): {why}")
        else:
            out.append(name)
    return out


def check_host(root: Root, task: Task, backend: Backend) -> None:
    """What this host must have for `task`, checked at the claim before the run path: its policy,
    whole, as the job root `root` holds it (policy_lacks: the file changed since the start, a
    credential file gone) and the task's engine's image (removed since the start). HostLacks when
    not. Nothing here depends on what the task asks for beyond its policy's name and its engine,
    which the runner chose to claim: what the task itself asks (a timeout over the policy's cap,
    an image or a fallback the policy does not allow) is the run path's, which fails the task
    `invalid` as on the file queue. A fallback's image, or the check's, missing here is not
    checked: the run path's ImageMissing counts against the task (another runner may have it;
    after its tries it fails saying what to build)."""
    why = policy_lacks(root, task.policy, backend)
    if why:
        raise HostLacks("policy", task.policy, f"policy {task.policy}: {why}")
    tag = get_engine(task.engine).image_tag()
    # A tag the task pins, other than its engine's own, is the task's to answer for.
    if task.image in (None, tag) and backend.image(tag) is None:
        raise HostLacks(
            "engine",
            task.engine,
            f"{backend.name} has no image {tag} (removed since the runner started)",
            hint=f"`fila images build {task.engine}` on this host",
        )

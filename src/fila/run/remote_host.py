"""What a PostgreSQL runner's host can run (docs/scale-out.md, "Running it"): the engines whose
image its container engine has, and the policies of its root that load and whose runtime it has.
A runner claims only these, so a task it could not run waits for a runner that can, its tries
unspent, rather than fail here for this host's lack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import FilaError, HostLacks, InfraError, InvalidPolicy, UnknownPolicy
from ..core.layout import Root
from ..core.models import Task
from ..engines import engine_names, get_engine
from ..queue.policy import load_policy, policy_names
from .intake import check_credentials_here

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


def runtime_missing(root: Root, name: str, backend: Backend) -> str | None:
    """Why this host cannot run a task of policy `name` (its container runtime missing), or None."""
    pol, _ = load_policy(root, name)
    want = backend.runtime_for(pol)
    if want is not None and want not in backend.runtimes():
        return (
            f"its runtime {want} is not in {backend.name} (it has: {', '.join(sorted(backend.runtimes()))})"
        )
    return None


def usable_policies(root: Root, backend: Backend, progress: Callable[[str], None]) -> list[str]:
    """The policies a runner started without --policy claims: each of its root's (and fila's
    shipped ones it does not override) that loads and whose runtime this host has. One that does
    not is left out and said: a task of it stays queued for a runner that has it, never run here
    under another policy of its name, nor failed here for this host's lack."""
    out = []
    for name in policy_names(root):
        try:
            why = runtime_missing(root, name, backend)
        except FilaError as e:
            why = f"{e}" + (f"; {e.hint}" if e.hint else "")
        if why:
            progress(f"fila worker: policy {name} left out (its tasks wait for another runner): {why}")
        else:
            out.append(name)
    return out


def check_host(root: Root, task: Task, backend: Backend) -> None:
    """What this host must have for `task`, checked before the run path: its policy as the host's
    root has it (it loads, its runtime is here, the credentials of the routes the task's engines
    use can be read) and the task's engine's image. HostLacks when not. What the task itself asks
    for (a timeout over the policy's cap, an image the policy does not allow, an engine the policy
    has no route for) is left to the run path, which fails the task `invalid` as on the file queue.
    A fallback's image, or the check's, missing here is not checked: the run path's ImageMissing
    counts against the task (another runner may have it; after its tries it fails saying what to
    build)."""
    name = task.policy
    try:
        why = runtime_missing(root, name, backend)
        if why:
            raise HostLacks("policy", name, f"policy {name}: {why}")
        policy, _ref = load_policy(root, name)
        check_credentials_here(root, task, policy)
    except (InvalidPolicy, UnknownPolicy) as e:
        raise HostLacks("policy", name, f"{e}" + (f"; {e.hint}" if e.hint else "")) from e
    except InfraError:  # the container engine not answering: the run path's hand-back says so
        raise
    except FilaError:
        pass  # the task's own fault (an engine of its chain unknown, say): the run path says so
    if task.image is None:
        tag = get_engine(task.engine).image_tag()
        if backend.image(tag) is None:
            raise HostLacks(
                "engine",
                task.engine,
                f"{backend.name} has no image {tag} (removed since the runner started)",
                hint=f"`fila images build {task.engine}` on this host",
            )

"""Which spare gateways a worker keeps (sandbox/gateways.py): one per egress network of the
`network: allowlist` policies its queued tasks name, made while the worker claims and prepares,
so that such a job takes a started gateway instead of paying the proxy's start-up on its path
(docs/benchmarks.md, "egress"). A long-running worker makes the next spare for a network as soon
as a job takes one; `once` (`fila run --once`, `submit --run`) makes only what its queue needs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import FilaError
from ..core.layout import Root
from ..queue import store as queue
from ..queue.policy import load_json, load_policy

if TYPE_CHECKING:
    from ..sandbox import Backend
    from ..sandbox.gateways import GatewayPool

# A queue of thousands is not read whole for this: the first tasks decide the first spares, and
# each take makes the next.
PEEK = 64


def keep(
    root: Root,
    backend: Backend,
    *,
    once: bool,
    only: set[str] | None = None,
    policies: list[str] | None = None,
) -> GatewayPool | None:
    """The backend's pool for this worker (None where the backend starts no gateway), asked in
    the background for the networks its queued tasks (`only` these ids, when given) need, or, for
    a runner of the PostgreSQL queue (whose tasks are not in `root`), those of `policies`."""
    pool = backend.spare_gateways(root.spares_dir, {"fila.root": str(root.path)}, refill=not once)
    if pool is None:
        return None

    def want() -> None:
        for network in networks(root, only, policies=policies):
            pool.want(network)

    threading.Thread(target=want, name="fila-spares", daemon=True).start()
    return pool


def close(
    pool: GatewayPool | None, backend: Backend, progress: Callable[[str], None], *, detach: bool = False
) -> None:
    """The spares not taken go with the worker (recovery's otherwise); what could not be made or
    removed is said. `detach` (a one-shot process about to exit): what is left to remove is the
    backend's reaper's, after this process (sandbox/docker/reap.py)."""
    if pool is None:
        return
    for left in pool.close(backend.handoff_gateways if detach else None) + pool.errors:
        progress(f"fila worker: {left}")
    backend.gateways = None


def networks(root: Root, only: set[str] | None = None, *, policies: list[str] | None = None) -> list[str]:
    """The egress networks of the allowlist policies named by the queued tasks (the first PEEK,
    or those `only` names), in queue order, or of `policies`. A task or policy that cannot be
    read is skipped here: its claim says why."""
    names: list[str] = list(policies or [])
    with contextlib.suppress(OSError):
        queued = [] if policies is not None else queue.queued_files(root)[:PEEK]
        for path in queued if only is None else [root.queued_path(t) for t in only]:
            # Through the one safe reader: a queued file is untrusted (a FIFO, a nesting deep
            # enough to exhaust the recursion limit); its claim says what is wrong with it.
            with contextlib.suppress(FilaError):
                doc = load_json(path, "task")
                name = doc.get("policy", "default") if isinstance(doc, dict) else None
                if isinstance(name, str) and name not in names:
                    names.append(name)
    found: list[str] = []
    for name in names:
        with contextlib.suppress(FilaError, OSError, ValueError):
            policy, _ = load_policy(root, name)
            eg = policy.egress if policy.network == "allowlist" else None
            if eg is not None and eg.egress_network not in found:
                found.append(eg.egress_network)
    return found

"""Which spare gateways a worker keeps (sandbox/gateways.py): one per egress network of the
`network: allowlist` policies its queued tasks name, made while the worker claims and prepares,
so that such a job takes a started gateway instead of paying mitmdump's start-up on its path
(docs/benchmarks.md, "egress"). A long-running worker makes the next spare for a network as soon
as a job takes one; `once` (`fila run --once`, `submit --run`) makes only what its queue needs.
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import TYPE_CHECKING

from ..core.errors import FilaError
from ..core.layout import Root
from ..queue import store as queue
from ..queue.policy import load_policy

if TYPE_CHECKING:
    from ..sandbox import Backend
    from ..sandbox.gateways import GatewayPool

# A queue of thousands is not read whole for this: the first tasks decide the first spares, and
# each take makes the next.
PEEK = 64


def keep(root: Root, backend: Backend, *, once: bool, only: set[str] | None = None) -> GatewayPool | None:
    """The backend's pool for this worker (None where the backend starts no gateway), asked in
    the background for the networks its queued tasks (`only` these ids, when given) need."""
    pool = backend.spare_gateways(root.spares_dir, {"fila.root": str(root.path)}, refill=not once)
    if pool is None:
        return None

    def want() -> None:
        for network in networks(root, only):
            pool.want(network)

    threading.Thread(target=want, name="fila-spares", daemon=True).start()
    return pool


def networks(root: Root, only: set[str] | None = None) -> list[str]:
    """The egress networks of the allowlist policies named by the queued tasks (the first PEEK,
    or those `only` names), in queue order. A task or policy that cannot be read is skipped here:
    its claim says why."""
    names: list[str] = []
    with contextlib.suppress(OSError):
        for path in queue.queued_files(root)[:PEEK] if only is None else [root.queued_path(t) for t in only]:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                name = json.loads(path.read_bytes()).get("policy", "default")
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

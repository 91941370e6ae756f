"""Policies: in memory for the library, written under policies/ for the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fila.core.layout import Root
from fila.core.models import Policy

if TYPE_CHECKING:
    from tests.upstreams import Upstreams


def policy(**kw: object) -> Policy:
    """A policy in memory: the required timeouts (60 s at most, 10 s by default) and `kw`."""
    return Policy.model_validate({"max_timeout_ms": 60_000, "default_timeout_ms": 10_000} | kw)


def write_policy(root: Path | Root, name: str, doc: dict[str, Any]) -> Path:
    """policies/<name>.json of the queue root `root`, holding `doc`."""
    path = (root.path if isinstance(root, Root) else root) / "policies" / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def edit_policy(root: Path | Root, name: str, *, to: str | None = None, **fields: Any) -> Path:
    """policies/<name>.json with `fields` over what it holds, written back (or as policies/<to>.json)."""
    base = (root.path if isinstance(root, Root) else root) / "policies"
    doc = json.loads((base / f"{name}.json").read_text())
    return write_policy(root, to or name, doc | fields)


def model_route(ups: Upstreams, credential: str) -> dict[str, Any]:
    """A route to the scripted model server (tests/upstreams), its key from the variable `credential`."""
    return {"upstream": "https://model.test", "credential": credential, "ca_file": str(ups.ca_file)}


def model_policy(ups: Upstreams, routes: dict[str, dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A policy document for engines that talk to the scripted model server through the gateway:
    an allowlist, timeouts long enough for a CLI's start on a busy machine, `routes`, the upstreams'
    network reachable, and `extra` over that (its `egress` merged into the egress)."""
    egress = {"routes": routes, "allow_private": [ups.subnet], "egress_network": ups.network}
    return {
        "network": "allowlist",
        "max_timeout_ms": 300_000,
        "default_timeout_ms": 240_000,
        "grace_ms": 2000,
        **extra,
        "egress": egress | extra.get("egress", {}),
    }

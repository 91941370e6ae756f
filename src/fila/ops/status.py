"""`fila status`: the queue at a glance. Reads only; never settles anything (that is recovery)."""

from __future__ import annotations

import time
from typing import Any

from ..core.layout import Root
from ..core.models import Status
from ..queue import breaker, lease
from ..queue import store as queue


def _age(iso: str | None, now: float) -> float | None:
    from datetime import datetime

    if not iso:
        return None
    try:
        return round(now - datetime.fromisoformat(iso).timestamp(), 1)
    except ValueError:
        return None


def gather(root: Root, *, ttl: float | None = None) -> dict[str, Any]:
    root.require()
    ttl = lease.lease_ttl() if ttl is None else ttl
    now = time.time()
    recs = {r.id: r for r in queue.all_records(root)}
    counts = {s.value: 0 for s in Status}
    for r in recs.values():
        counts[r.status.value] += 1
    dropped = [p.stem for p in queue.queued_files(root) if p.stem not in recs]
    counts["queued"] += len(dropped)
    running, stale, tombstones = [], [], []
    for claim, suffix in queue.claims(root):
        path = claim.tombstone(suffix)
        if suffix != "json":
            tombstones.append({"id": claim.task_id, "file": path.name, "kind": suffix})
            continue
        rec = recs.get(claim.task_id)
        started = rec.attempts[-1].started_at if rec and rec.attempts else None
        why = lease.stale_reason(root, path, claim.worker, ttl=ttl)
        beat = lease.heartbeat_age(path, now)
        job = {
            "id": claim.task_id,
            "worker": claim.worker,
            "worker_alive": lease.worker_liveness(root, claim.worker),
            "attempt": rec.attempt if rec else None,
            "container_started": bool(rec and rec.container_started),
            "age_s": _age(started, now),
            "heartbeat_age_s": round(beat, 1) if beat else beat,
            "stale": why,
        }
        running.append(job)
        if why:
            stale.append(job)
    br = breaker.read(root)
    return {
        "root": str(root.path),
        "counts": counts,
        "dropped_files": dropped,
        "running": running,
        "stale_claims": stale,
        "tombstones": tombstones,
        "workers": lease.live_workers(root),
        "lease_ttl_s": ttl,
        "breaker": br.model_dump(),
    }


def render(d: dict[str, Any]) -> str:
    c = d["counts"]
    lines = [f"queue {d['root']}", "  " + "  ".join(f"{k} {v}" for k, v in c.items())]
    br = d["breaker"]
    if br["open"]:
        lines.append(
            f"breaker:  OPEN since {br['tripped_at']} ({br['reason']}); `fila rearm` lets workers claim again"
        )
    else:
        lines.append(f"breaker:  closed ({br['consecutive']} of {br['threshold']} consecutive failures)")
    lines.append(
        f"workers:  {len(d['workers'])} alive" + (f" ({', '.join(d['workers'])})" if d["workers"] else "")
    )
    if d["running"]:
        lines.append("running:")
        for j in d["running"]:
            age = f"{j['age_s']:.0f}s" if j["age_s"] is not None else "?"
            beat = f"{j['heartbeat_age_s']:.0f}s ago" if j["heartbeat_age_s"] is not None else "?"
            state = "container running" if j["container_started"] else "preparing"
            lines.append(
                f"  {j['id']}  {state}  age {age}  heartbeat {beat}  "
                f"worker {j['worker']} ({j['worker_alive']})"
                + (f"  STALE: {j['stale']}" if j["stale"] else "")
            )
    if d["stale_claims"]:
        lines.append(f"stale claims: {len(d['stale_claims'])}; `fila recover` settles them")
    if d["tombstones"]:
        lines.append("publishing or interrupted: " + ", ".join(t["file"] for t in d["tombstones"]))
    return "\n".join(lines)

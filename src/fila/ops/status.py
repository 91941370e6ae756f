"""`fila status`: the queue at a glance. Reads only; never settles anything (that is recovery)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..core.layout import Root
from ..core.models import Status
from ..queue import breaker, lease
from ..queue import store as queue

if TYPE_CHECKING:  # fila.queue.pg is imported only with a queue URL
    from ..queue.pg.breaker import PgBreaker


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


WAITING_IDS = 5  # ids shown per reason a queued task waits (`--json`'s `unrunnable` has them all)


def gather_queue(db: PgBreaker, *, live_s: float) -> dict[str, Any]:
    """`fila status --queue URL`: task counts, the runners the queue knows (live: seen within
    `live_s` seconds on the database's clock, not stopped), and the queued tasks no live runner
    can take (their engine on no live runner, or on none that takes their policy: `fila worker
    --policy`), which wait until one that can starts: every one (`unrunnable`) and grouped by why
    (`waiting`: count and the first ids, oldest first); and the queue's circuit breaker."""
    runners = db.runners(live_s)
    live = [r for r in runners if r["live"]]
    stuck = []
    for tid, eng, pol in db.queued():
        with_engine = [r for r in live if eng in r["engines"]]
        if not with_engine:
            stuck.append({"id": tid, "engine": eng, "policy": pol, "why": f"no live runner has engine {eng}"})
        elif not any(r.get("policies") is None or pol in r["policies"] for r in with_engine):
            why = f"no live runner with engine {eng} takes policy {pol}"
            stuck.append({"id": tid, "engine": eng, "policy": pol, "why": why})
    counts: dict[str, int] = {}
    for state, by_engine in db.counts().items():
        counts[state] = sum(by_engine.values())
    groups: dict[str, dict[str, Any]] = {}
    for t in stuck:
        g = groups.setdefault(t["why"], {"why": t["why"], "count": 0, "ids": []})
        g["count"] += 1
        if len(g["ids"]) < WAITING_IDS:
            g["ids"].append(t["id"])
    waiting = sorted(groups.values(), key=lambda g: -g["count"])
    return {"queue": db.where, "counts": counts, "breaker": db.breaker().model_dump(), "runners": runners,
            "unrunnable": stuck, "waiting": waiting, "live_s": live_s}  # fmt: skip


def render_queue(d: dict[str, Any]) -> str:
    lines = [f"queue {d['queue']}", "  " + "  ".join(f"{k} {v}" for k, v in sorted(d["counts"].items()))]
    br = d["breaker"]
    if br["open"]:
        lines.append(f"breaker:  OPEN since {br['tripped_at']} by {br['tripped_by']} ({br['reason']}); "
                     "`fila rearm --queue URL` lets runners claim again")  # fmt: skip
    else:
        lines.append(f"breaker:  closed ({br['consecutive']} of {br['threshold']} consecutive failures)")
    live = [r for r in d["runners"] if r["live"]]
    lines.append(f"runners:  {len(live)} live of {len(d['runners'])} known")
    for r in d["runners"]:
        state = (
            "live" if r["live"] else ("stopped" if r["stopped_at"] else f"not seen for {d['live_s']:.0f}s")
        )
        lines.append(
            f"  {r['id']}  {state}  engines {', '.join(r['engines'])}"
            + (f"  policies {', '.join(r['policies'])}" if r.get("policies") is not None else "")
            + f"  slots {r['slots']}  seen {r['seen_s']:.0f}s ago"
        )
    for g in d["waiting"]:
        more = f" and {g['count'] - len(g['ids'])} more" if g["count"] > len(g["ids"]) else ""
        lines.append(f"waiting:  {g['count']} {'task' if g['count'] == 1 else 'tasks'}: {g['why']} "
                     f"({', '.join(g['ids'])}{more})")  # fmt: skip
    return "\n".join(lines)

"""Groups of tasks that ran the same input on different engines, and how they compare.

`fila submit --engine claude --engine codex ...` queues one task per engine with the same `group`
(`group_tasks`, queued by intake.submit_group, or by PgQueue.enqueue_group in one transaction on a
PostgreSQL queue); `comparison` puts the members' records side by side, from either queue (status,
files touched, +/- lines, duration, requests, tokens, cost, the check); `supersede_others` marks
every other member when a person applies one on the file queue (a PostgreSQL queue's
PgQueue.decide_group does it in the decision's transaction). A superseded member is `rejected` with a decision
`superseded` (who, when, which member won): the state machine keeps its table, and a superseded
task can never be applied.

The task's optional `check` runs with the job (run/check.py); here it is one more column.
"""

from __future__ import annotations

import contextlib
import fcntl
import html
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.errors import InvalidTaskFile, NotFound
from ..core.layout import Root
from ..core.models import Decision, Record, Status, Task, now_iso
from ..queue import store as queue
from ..queue.records import check_group, superseded_reason
from ..workspace.fswalk import inert

# -- groups ---------------------------------------------------------------------------------------


def members(root: Root, group: str) -> list[Record]:
    """The group's tasks, by id. NotFound when none has that group (see no_group)."""
    recs = queue.all_records(root.require())
    found = [r for r in recs if r.task is not None and r.task.group == group]
    if not found:
        raise no_group(group, next((r for r in recs if r.id == group), None))
    return sorted(found, key=lambda r: r.id)


def no_group(group: str, same_id: Record | None, where: str = "") -> NotFound:
    """The error for a group no task has (`where`: " in the queue database ..."); `same_id` is
    the task whose id is `group`, if any: a member's id given for its group is named as such."""
    if same_id is not None and same_id.task is not None and same_id.task.group:
        return NotFound(
            f"{group!r} is a task of group {same_id.task.group!r}, not a group{where}",
            task_id=group,
            hint=f"`fila compare {same_id.task.group}` compares its group; `fila show {group}` the task",
        )
    return NotFound(
        f"no task in group {group!r}{where}",
        hint="`fila submit --engine A --engine B ...` makes a group; `fila ls` lists tasks",
    )


def group_tasks(task: Task, engines: list[str], *, models: dict[str, str] | None = None) -> list[Task]:
    """One task per engine on the same prompt, targets and policy, in one group (queued by
    `intake.submit_group`). The group id is the task's `group`, else its `id`, else a new id; members
    are `<group>.<engine>`; `models` gives an engine its own model (a model name is one vendor's)."""
    if len(set(engines)) != len(engines):
        dup = next(e for e in engines if engines.count(e) > 1)
        raise InvalidTaskFile(f"engine {dup!r} is named twice for one group", field="engine")
    if task.image:
        raise InvalidTaskFile(
            "a pinned image is one engine's, and this group has several",
            field="image",
            hint="submit one task file per engine with the same `group`, each pinning its image",
        )
    group = task.group or task.id or queue.new_task_id()
    models = models or {}
    for name in models:
        if name not in engines:
            raise InvalidTaskFile(
                f"--model {name}=... names an engine not in the group ({', '.join(engines)})", field="model"
            )
    return [
        task.model_copy(
            update={"engine": e, "group": group, "id": f"{group}.{e}", "model": models.get(e, task.model)}
        )
        for e in engines
    ]


@contextlib.contextmanager
def group_lock(root: Root, group: str) -> Iterator[None]:
    """One decision at a time per group: two people applying two members at once cannot both
    land. '~' is in no task id, so this lock is never a task's record lock."""
    fd = os.open(root.out_dir / f".group~{group}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def check_not_decided(root: Root, rec: Record) -> None:
    """Refuse to apply a member when another member of its group was applied already."""
    if rec.task is None or rec.task.group is None or rec.status != Status.needs_review:
        return  # not a member, or decided itself: the apply's own check says what was decided
    check_group(rec, members(root, rec.task.group))


@dataclass
class Superseded:
    done: list[str] = field(default_factory=list)
    # Members still queued or running: not superseded now; `fila reject` them when they finish.
    undecided: list[str] = field(default_factory=list)


def supersede_others(root: Root, winner: Record, *, by: str) -> Superseded:
    """Mark every other member of the winner's group superseded (status rejected, decision
    superseded: who, when, which member was applied). Members already decided stay as they are."""
    from . import decision

    out = Superseded()
    if winner.task is None or winner.task.group is None:
        return out
    group = winner.task.group
    for m in members(root, group):
        if m.id == winner.id:
            continue
        with decision.lock(root, m.id):
            cur = queue.get_record(root, m.id)
            if cur.status in (Status.queued, Status.running):
                out.undecided.append(m.id)
                continue
            if cur.status not in decision.DECIDABLE["reject"]:
                continue  # rejected or superseded before: history stays
            d = Decision(action="superseded", by=by, at=now_iso(), reason=superseded_reason(group, winner.id))
            queue.set_status(
                root,
                m.id,
                Status.rejected,
                expect=decision.DECIDABLE["reject"],
                event="superseded",
                decision=d,
                log={"decision": d.model_dump(mode="json")},
            )
            out.done.append(m.id)
    return out


# -- the comparison -------------------------------------------------------------------------------


@dataclass
class Row:
    id: str
    engine: str | None
    model: str | None
    status: str
    decision: str | None
    tried: list[str]  # engines in the order they ran: a fallback shows as claude(quota) -> shell
    files: list[str]
    insertions: int | None
    deletions: int | None
    duration_s: float | None
    requests: int | None  # what the gateway measured (network allowlist)
    input_tokens: int | None  # the gateway's count, else the CLI's report
    output_tokens: int | None
    tokens_from: str | None  # "gateway" or "cli"
    cost_usd: float | None  # the CLI's report: the gateway sees tokens, not prices
    check: str | None  # the command
    check_passed: bool | None
    check_exit: int | None
    error: str | None
    image: str | None


@dataclass
class Comparison:
    group: str
    prompt: str | None
    targets: list[str]
    rows: list[Row]


def _row(rec: Record) -> Row:
    st, eg, rep, ck = rec.diffstat, rec.egress, rec.engine_report, rec.check
    tried = [f"{a.engine}({a.outcome})" for a in rec.attempts if a.outcome == "quota"]
    if rec.engine:
        tried.append(rec.engine)
    requests = inp = out = None
    source = None
    if eg is not None and eg.routes:
        requests = sum(r.requests for r in eg.routes.values())
        inp = sum(r.input_tokens for r in eg.routes.values())
        out = sum(r.output_tokens for r in eg.routes.values())
        source = "gateway"
    elif rep is not None and (rep.input_tokens is not None or rep.output_tokens is not None):
        inp, out, source = rep.input_tokens, rep.output_tokens, "cli"
    d = rec.decision
    return Row(
        id=rec.id,
        engine=rec.engine or (rec.task.engine if rec.task else None),
        model=(rep.model if rep and rep.model else None) or rec.model,
        status=str(rec.status),
        decision=f"{d.action} by {d.by} at {d.at}" if d else None,
        tried=tried,
        files=list(st.paths) if st else [],
        insertions=st.insertions if st else None,
        deletions=st.deletions if st else None,
        duration_s=rec.timings.get("total"),
        requests=requests,
        input_tokens=inp,
        output_tokens=out,
        tokens_from=source,
        cost_usd=rep.cost_usd if rep else None,
        check=rec.task.check if rec.task else None,
        check_passed=ck.passed if ck else None,
        check_exit=ck.exit_code if ck else None,
        error=f"{rec.error.kind}: {rec.error.message}" if rec.error else None,
        image=(rec.image.id or rec.image.tag) if rec.image else None,
    )


def compare(root: Root, group: str) -> Comparison:
    """The file queue's group, compared (comparison)."""
    return comparison(group, members(root, group))


def comparison(group: str, recs: list[Record]) -> Comparison:
    """The members' records side by side, from either queue (the file queue's `members`, or a
    PostgreSQL queue's review/remote.queued_members): one table, one renderer."""
    recs = sorted(recs, key=lambda r: r.id)
    first = recs[0].task if recs else None
    return Comparison(
        group=group,
        prompt=first.prompt if first else None,
        targets=list(first.targets) if first else [],
        rows=[_row(r) for r in recs],
    )


def to_json(c: Comparison) -> dict[str, Any]:
    return asdict(c)


def _n(v: float | int | None, fmt: str = "{}") -> str:
    return "-" if v is None else fmt.format(v)


def _check_cell(r: Row) -> str:
    if r.check is None:
        return "-"
    if r.check_passed is None:
        return "not run"
    return "passed" if r.check_passed else f"failed ({_n(r.check_exit)})"


COLUMNS: list[tuple[str, Callable[[Row], str]]] = [
    ("task", lambda r: r.id),
    ("engine", lambda r: " -> ".join(r.tried) or (r.engine or "-")),
    ("model", lambda r: r.model or "-"),
    (
        "status",
        lambda r: r.status + (" (superseded)" if r.decision and r.decision.startswith("superseded") else ""),
    ),
    ("files", lambda r: str(len(r.files))),
    ("+/-", lambda r: f"+{_n(r.insertions)} -{_n(r.deletions)}"),
    ("seconds", lambda r: _n(r.duration_s, "{:.1f}")),
    ("requests", lambda r: _n(r.requests)),
    ("tokens in/out", lambda r: f"{_n(r.input_tokens)}/{_n(r.output_tokens)}"),
    ("cost $", lambda r: _n(r.cost_usd, "{:.4f}")),
    ("check", _check_cell),
]


def render_lines(c: Comparison) -> list[str]:
    """A plain table, one member a line, then each member's files and error. Untrusted text
    (paths, messages) is escaped by the caller, line by line."""
    cells = [[name for name, _f in COLUMNS], *([f(r) for _n2, f in COLUMNS] for r in c.rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = [f"group {c.group}: {len(c.rows)} tasks on {', '.join(c.targets)}"]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    for r in c.rows:
        details = [f"  {p}" for p in r.files]
        if r.error:
            details.append(f"  error: {r.error}")
        if r.check:
            details.append(f"  check: {r.check}")
        if r.decision:
            details.append(f"  decision: {r.decision}")
        if details:
            lines += ["", f"{r.id}:", *details]
    return lines


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;background:#fff}
table{border-collapse:collapse}
td,th{border:1px solid #ddd;padding:.3em .6em;vertical-align:top;text-align:left}
th{background:#f4f4f4}.pass{color:#116329}.fail{color:#a40e26}.none{color:#666}
code,pre{font:12px/1.35 ui-monospace,Menlo,Consolas,monospace}
"""


def render_html(c: Comparison) -> str:
    """One self-contained page: no external asset can load and no script runs (CSP), every
    value made inert (control, format and bidi characters escaped, as the text table and
    REVIEW.html do: it holds engine-written paths, models and messages), then HTML-escaped."""
    h = lambda s: html.escape(inert(str(s)), quote=True)  # noqa: E731
    title = f"fila compare: group {c.group}"
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'\">",
        f"<title>{h(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{h(title)}</h1>",
        f"<p>targets: <code>{h(', '.join(c.targets))}</code></p>",
        f"<pre>{h(c.prompt or '')}</pre>",
        "<table><tr>"
        + "".join(f"<th>{h(name)}</th>" for name, _f in COLUMNS)
        + "<th>files touched</th></tr>",
    ]
    for r in c.rows:
        cls = "none" if r.check_passed is None else ("pass" if r.check_passed else "fail")
        cells = [f"<td>{h(f(r))}</td>" for name, f in COLUMNS if name != "check"]
        cells.append(f'<td class="{cls}">{h(_check_cell(r))}</td>')
        files = "<br>".join(f"<code>{h(p)}</code>" for p in r.files) or '<span class="none">none</span>'
        cells.append(f"<td>{files}</td>")
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("</table>")
    for r in c.rows:
        extra = [
            *([f"<li>error: {h(r.error)}</li>"] if r.error else []),
            *([f"<li>check: <code>{h(r.check)}</code></li>"] if r.check else []),
            *([f"<li>decision: {h(r.decision)}</li>"] if r.decision else []),
            *([f"<li>image: <code>{h(r.image)}</code></li>"] if r.image else []),
        ]
        if extra:
            parts.append(f"<h2>{h(r.id)}</h2><ul>{''.join(extra)}</ul>")
    parts.append(f'<p class="none">Written by fila at {h(now_iso())}.</p></body></html>')
    return "\n".join(parts) + "\n"

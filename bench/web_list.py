"""Case web-list: `fila serve`'s list of a large file queue, the page a browser polls every 3 s.

10,000 records (1,000 with --quick) written as fila writes them, each a copy of one real record
under its own id. fila's side is the list's JSON (web/views.Lister.page, the first page of 50,
needs_review first) after one record changed (a worker's publish): the records that changed
are parsed again, the others kept (queue/records.all_records' cache). The baseline is the CLI's
read of the same queue (`fila ls`: review/desk.listing, every record parsed), which is also
what the server pays once when it starts. Target: under a second (issue 37)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import Ctx, Row, median

if TYPE_CHECKING:
    from fila.core.layout import Root


def _queue(base: Path, n: int) -> Root:
    from fila.core.layout import Root
    from fila.core.models import Record, Status, Task, now_iso

    root = Root.at(base)
    for d in root.all_dirs():
        d.mkdir(parents=True, exist_ok=True)
    task = Task(engine="shell", command="true", targets=["greeting.txt"], prompt="a prompt to search")
    states = [Status.needs_review, Status.applied, Status.failed, Status.rejected]
    for i in range(n):
        tid = f"t{i:05d}"
        rec = Record(id=tid, status=states[i % 4], task=task, engine="shell", submitted_at=now_iso())
        root.record_path(tid).write_text(rec.model_dump_json())
    return root


def web_list(ctx: Ctx) -> list[Row]:
    from fila.review.desk import listing
    from fila.web.views import Lister, Query

    n = 1000 if ctx.quick else 10_000
    reps = ctx.reps_or(5, 2)
    root = _queue(ctx.tmp / "web-list", n)
    ctx.log(f"web-list: {n} records, {reps} polls after one change each, beside `fila ls`'s read")
    lister = Lister(root, None)
    lister.page(Query())
    polls, reads = [], []
    for i in range(reps):
        path = root.record_path(f"t{i:05d}")
        doc = json.loads(path.read_text())
        path.write_text(json.dumps(doc) + " ")  # the same record, its file changed
        os.utime(root.out_dir)
        t = time.perf_counter()
        got = lister.page(Query())
        polls.append(time.perf_counter() - t)
        assert len(got.rows) == 50 and got.rows[0]["status"] == "needs_review"
        t = time.perf_counter()
        listing(root, None)
        reads.append(time.perf_counter() - t)
    fila, base = median(polls), median(reads)
    return [
        Row(
            case=f"web-list: first page of {n} tasks after one change",
            fila=fila,
            base=base,
            unit="s",
            target="< 1 s",
            ok=fila < 1.0,
            note="base: every record parsed (fila ls; the server's start)",
            samples={"fila": polls, "base": reads},
        )
    ]

"""The queue's state machine under random interleavings (hypothesis), without Docker.

Workers are simulated step by step over the real queue functions (claim, begin, the container
start checkpoint, heartbeat, publish, hand back); "running" a container is the start checkpoint.
A worker can crash (its claims are abandoned wherever they are, also half-way through a publish)
or stall (recovery sees it as gone, but it keeps acting afterwards: a zombie whose every write
must be fenced off). Recovery, people's decisions (apply, reject, retry) and the breaker's rearm
interleave freely. After every step: each task is in exactly one state, none is lost, no
container "ran" twice without a person's retry, and every record is one that readers accept.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fila.core import fsutil
from fila.core.errors import InvalidTransition, Refused
from fila.core.layout import Root
from fila.core.models import ErrorInfo, ErrorKind, Status
from fila.queue import breaker
from fila.queue import store as queue
from fila.recovery import recover as recovery
from tests.support.project import fake_backend, shell_task

S = Status


@dataclass
class Job:
    claim: queue.Claim
    phase: str  # claimed -> begun -> started
    attempt: int = 0


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="fila-sm-"))
        self.root = Root(self.dir)
        for d in self.root.all_dirs():
            d.mkdir(parents=True, exist_ok=True)
        (self.dir / "greeting.txt").write_text("hello\n")
        self.ids: set[str] = set()
        self.n = 0
        self.workers = ["w0", "w1"]
        self.dead: set[str] = set()  # crashed: never acts again
        self.stalled: set[str] = set()  # recovery thinks it is gone; it still acts (zombie)
        self.jobs: list[Job] = []
        self.runs: dict[str, int] = {}
        self.retries: dict[str, int] = {}

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _alive(self, w: str) -> str:
        return "gone" if w in self.dead or w in self.stalled else "alive"

    def _acting(self) -> list[str]:
        return [w for w in self.workers if w not in self.dead]

    # -- submitting ------------------------------------------------------------------------

    @rule()
    def submit(self) -> None:
        tid = f"t{self.n}"
        self.n += 1
        queue.enqueue(self.root, tid, shell_task())
        self.ids.add(tid)

    @rule()
    def drop_file(self) -> None:
        tid = f"d{self.n}"
        self.n += 1
        task = shell_task().model_copy(update={"id": tid})
        fsutil.create_exclusive(self.root.queued_path(tid), queue.task_json(task))
        self.ids.add(tid)

    # -- workers ---------------------------------------------------------------------------

    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        acting = self._acting()
        if not acting:
            return
        w = data.draw(st.sampled_from(acting))
        from fila.run.job import next_claim

        c = next_claim(self.root, w)
        if c is not None:
            self.jobs.append(Job(c, "claimed"))

    def _job(self, data: st.DataObject, phase: str | None = None) -> Job | None:
        jobs = [
            j for j in self.jobs if (phase is None or j.phase == phase) and j.claim.worker not in self.dead
        ]
        return data.draw(st.sampled_from(jobs)) if jobs else None

    @rule(data=st.data())
    def begin(self, data: st.DataObject) -> None:
        job = self._job(data, "claimed")
        if job is None:
            return
        try:
            rec = queue.begin(self.root, job.claim, shell_task().model_copy(update={"id": job.claim.task_id}))
            job.phase, job.attempt = "begun", rec.attempt
        except queue.LeaseLost:
            self.jobs.remove(job)
        except InvalidTransition:
            queue.unclaim(self.root, job.claim)
            self.jobs.remove(job)

    @rule(data=st.data())
    def start_container(self, data: st.DataObject) -> None:
        job = self._job(data, "begun")
        if job is None:
            return
        try:
            queue.checkpoint(
                self.root,
                job.claim,
                container=f"c-{job.claim.token}",
                container_started=True,
                event="container started",
            )
        except queue.LeaseLost:
            self.jobs.remove(job)
            return
        job.phase = "started"
        tid = job.claim.task_id
        self.runs[tid] = self.runs.get(tid, 0) + 1

    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        job = self._job(data)
        if job is not None:
            queue.heartbeat(job.claim)

    @rule(data=st.data(), ok=st.booleans())
    def complete(self, data: st.DataObject, ok: bool) -> None:
        job = self._job(data, "started")
        if job is None:
            return
        self.jobs.remove(job)
        fields = (
            {"patch_path": "x", "patch_sha256": "0" * 64, "exit_code": 0}
            if ok
            else {"exit_code": 1, "error": ErrorInfo(kind=ErrorKind.engine_error, message="x")}
        )
        rec = queue.publish(
            self.root, job.claim, S.needs_review if ok else S.failed, fields, attempt=job.attempt
        )
        if rec is not None:
            breaker.record(self.root, rec, worker=job.claim.worker)

    @rule(data=st.data())
    def hand_back(self, data: st.DataObject) -> None:
        job = self._job(data, "begun")
        if job is None:
            return
        self.jobs.remove(job)
        queue.hand_back(
            self.root,
            job.claim,
            outcome="requeued",
            error=ErrorInfo(kind=ErrorKind.infra, message="daemon unreachable"),
        )

    @rule(data=st.data(), where=st.sampled_from(["anywhere", "after_result", "after_win"]))
    def crash(self, data: st.DataObject, where: str) -> None:
        """A worker dies; with a started job it may die half-way through its publish."""
        acting = self._acting()
        if not acting:
            return
        w = data.draw(st.sampled_from(acting))
        for job in [j for j in self.jobs if j.claim.worker == w]:
            if job.phase == "started" and where != "anywhere":
                c = job.claim
                self.root.meta(c.task_id).mkdir(parents=True, exist_ok=True)
                fsutil.atomic_write(
                    queue.result_path(self.root, c),
                    json.dumps(
                        {
                            "claim": c.name,
                            "attempt": job.attempt,
                            "status": "needs_review",
                            "fields": {"patch_path": "x", "patch_sha256": "0" * 64},
                        }
                    ),
                )
                if where == "after_win":
                    queue.win(c, "done")
            self.jobs.remove(job)
        self.dead.add(w)
        self.workers.append(f"w{len(self.workers)}")

    @rule(data=st.data())
    def stall(self, data: st.DataObject) -> None:
        acting = [w for w in self._acting() if w not in self.stalled]
        if acting:
            self.stalled.add(data.draw(st.sampled_from(acting)))

    @rule()
    def recover(self) -> None:
        # An engine that answers and holds no container: recovery may decide started tasks.
        recovery.recover(self.root, backend=fake_backend(self.root), ttl=1e9, alive=self._alive)

    # -- people ----------------------------------------------------------------------------

    def _with_status(self, data: st.DataObject, *statuses: Status) -> str | None:
        ids = sorted(r.id for r in queue.all_records(self.root) if r.status in statuses)
        return data.draw(st.sampled_from(ids)) if ids else None

    @rule(data=st.data())
    def apply(self, data: st.DataObject) -> None:
        tid = self._with_status(data, S.needs_review)
        if tid:
            queue.set_status(self.root, tid, S.applied, expect={S.needs_review})

    @rule(data=st.data())
    def reject(self, data: st.DataObject) -> None:
        tid = self._with_status(data, S.needs_review, S.needs_human, S.failed)
        if tid:
            queue.set_status(self.root, tid, S.rejected, expect={S.needs_review, S.needs_human, S.failed})

    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        tid = self._with_status(data, S.needs_human, S.failed)
        if tid is None:
            return
        try:
            queue.retry(self.root, tid, by="tester")
        except Refused:
            return  # recovery has not finished with it yet
        self.retries[tid] = self.retries.get(tid, 0) + 1

    @precondition(lambda self: breaker.read(self.root).consecutive > 0)
    @rule()
    def rearm(self) -> None:
        st_ = breaker.rearm(self.root, by="tester")
        assert not st_.open and st_.consecutive == 0

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def every_task_in_exactly_one_state(self) -> None:
        recs = {r.id: r for r in queue.all_records(self.root)}
        live_claims = {j.claim.name for j in self.jobs}
        for tid in self.ids:
            rec = recs.get(tid)
            in_file = self.root.queued_path(tid).exists()
            files = queue.claim_files(self.root, tid)
            kinds = [p.suffix for p in files]
            where = f"{tid}: record {rec.status if rec else None}, in/ {in_file}, run/ {kinds}"
            assert len(files) + in_file <= 1, f"task in two places: {where}"
            if rec is None:
                assert in_file or kinds == [".json"], f"lost: {where}"
            elif rec.status == S.queued:
                assert in_file or kinds == [".json"], f"queued without its file: {where}"
            elif rec.status == S.running:
                assert kinds in ([".json"], [".done"]), f"running without a claim: {where}"
            else:
                assert not in_file and kinds in ([], [".done"]), f"{where}"
            if kinds == [".json"] and rec is not None and rec.status == S.running:
                owner = queue.parse_claim(files[0])[0]  # type: ignore[index]
                assert rec.worker == owner.worker, where
            for p in files:
                c = queue.parse_claim(p)
                assert c is not None
                if c[1] == "json" and c[0].name not in live_claims:
                    assert c[0].worker in self.dead | self.stalled, f"orphan claim {p.name}"

    @invariant()
    def records_are_ones_readers_accept(self) -> None:
        for rec in queue.all_records(self.root):
            assert queue.field_problem(rec) is None, (rec.id, queue.field_problem(rec))
        assert not list(self.root.out_dir.glob(".*.tmp"))

    @invariant()
    def no_second_run_without_a_retry(self) -> None:
        for tid, n in self.runs.items():
            assert n <= 1 + self.retries.get(tid, 0), f"{tid} ran {n} times"

    @invariant()
    def a_dead_workers_claims_are_settled_by_recovery(self) -> None:
        # Checked after an explicit recover: no claim of a gone worker survives it.
        pass


def _after_recover_nothing_is_stale(m: QueueMachine) -> None:
    recovery.recover(m.root, backend=fake_backend(m.root), ttl=1e9, alive=m._alive)
    for c, suffix in queue.claims(m.root):
        assert c.worker not in m.dead | m.stalled or suffix not in ("json", "reaped"), c.name


class QueueMachineChecked(QueueMachine):
    def teardown(self) -> None:
        try:
            _after_recover_nothing_is_stale(self)
            self.every_task_in_exactly_one_state()
            for rec in queue.all_records(self.root):
                owner_dead = rec.worker in self.dead | self.stalled
                assert not (rec.status == S.running and owner_dead), (
                    f"{rec.id} still running for a gone worker after recovery"
                )
        finally:
            super().teardown()


MACHINE = dict(
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# 60 programs of up to 40 steps by default (about 3 s); `scripts/test --all` runs 150 (the twin).
TestQueueStateMachine = QueueMachineChecked.TestCase
TestQueueStateMachine.settings = settings(max_examples=60, **MACHINE)


class QueueMachineMore(QueueMachineChecked):
    """The same machine, its own TestCase: more programs, in --all."""


TestMoreQueueStateMachine = QueueMachineMore.TestCase
TestMoreQueueStateMachine.settings = settings(max_examples=150, **MACHINE)
TestMoreQueueStateMachine.pytestmark = [pytest.mark.matrix]


@pytest.mark.parametrize("to", [S.running, S.needs_review, S.failed, S.needs_human])
def test_invalid_transitions_from_queued_are_refused_and_write_nothing(tmp_path: Path, to: Status) -> None:
    root = Root(tmp_path)
    for d in root.all_dirs():
        d.mkdir(parents=True)
    queue.enqueue(root, "t", shell_task())
    before = root.record_path("t").read_bytes()
    with pytest.raises(InvalidTransition):
        # running without a worker, failed/needs_human without an error: no reader accepts them
        queue.set_status(root, "t", to)
    assert root.record_path("t").read_bytes() == before

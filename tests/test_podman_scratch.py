"""A rootless Podman overlay scratch left with no container (its worker killed between the
container's removal and the scratch's) is emptied by recovery, by `fila gc` through the backend and
before a retried task's next attempt, and a live job's scratch never is. Real rootless Podman, as
an ordinary user the test creates (one user and one shell build for all of it)."""

from __future__ import annotations

import pytest

from tests.support.users import run_as_podman_user

pytestmark = pytest.mark.docker

# Run as the test's user: one failed run on the overlay strategy (a1), a second task (a2) claimed by
# a worker that is alive (its lease lock held by this process), and in both meta directories the
# kernel's work/ of a subordinate uid, mode 000, that a worker killed after its container's removal
# leaves. Then one recovery pass, gc of a1 once rejected with its scratch planted again, and a
# third task (a3) failed, its scratch planted, retried and run once more.
_SCRIPT = r"""
from fila.run import job as cycle
from fila.review import decision
from fila.recovery import gc, recover as recovery
from fila.queue import lease, store as queue
from fila.core.layout import Root
def submit(tid):
    fila("submit", "--root", str(q), "--id", tid, "--engine", "shell", "--command", "exit 3",
         "--target", "greeting.txt")
submit("a1")
fila("run", "--once", "--root", str(q))
first = json.loads((q / "fila/out/a1.json").read_text())
submit("a2")
root = Root(q)
worker = queue.new_worker_id()
held = lease.WorkerLock(root, worker).acquire()
claim = cycle.next_claim(root, worker, only={"a2"})
def plant(tid):
    s = q / "sandbox/meta" / tid / "overlay/work"
    cmd = f"mkdir -p {s}/work/x && chown -R 1:1 {s}/work && chmod 000 {s}/work"
    subprocess.run(["podman", "unshare", "sh", "-c", cmd], check=True)
    return s / "work"
a1, a2 = plant("a1"), plant("a2")
planted_rm = subprocess.run(["rm", "-rf", str(a1)], capture_output=True, text=True).returncode
rep = recovery.recover(root)
actions = [[a.task_id, a.action, a.detail] for a in rep.actions]
after_recovery = {"a1": a1.exists(), "a2": a2.exists(), "a2_claimed": bool(queue.claim_files(root, "a2"))}
plant("a1")
decision.reject(root, "a1", by="test", reason="scratch test")
got = gc.collect(root, 0)
after_gc = {"collected": [c.id for c in got], "a1_meta": (q / "sandbox/meta/a1").exists(),
            "a2": a2.exists(), "events": (q / "fila/logs/a1.events.jsonl").read_text()
            if (q / "fila/logs/a1.events.jsonl").exists() else ""}
# a3: failed on the overlay, its scratch left, retried: the next attempt runs on a cleared one.
submit("a3")
fila("run", "--once", "--root", str(q))
a3 = plant("a3")
retry = {"planted_rm": subprocess.run(["rm", "-rf", str(a3)], capture_output=True, text=True).returncode}
fila("retry", "a3", "--root", str(q), "--by", "test")
code, retry["out"] = fila("run", "--once", "--root", str(q))
retry["second"] = json.loads((q / "fila/out/a3.json").read_text())
retry["left"] = a3.exists()
held.release()
print(json.dumps({"first": first, "claim": claim is not None, "planted_rm": planted_rm,
                  "actions": actions, "after_recovery": after_recovery, "after_gc": after_gc,
                  "retry": retry}))
"""


def test_recovery_gc_and_the_next_attempt_clear_a_left_rootless_scratch_and_keep_a_live_jobs() -> None:
    got = run_as_podman_user(_SCRIPT)
    # The setup is what it claims: a1 ran on the overlay, its planted scratch defeats the user's rm,
    # and a2 is claimed by a live worker.
    assert got["first"]["exit_code"] == 3 and got["first"]["workspace"]["strategy"] == "overlay", got
    assert got["planted_rm"] != 0 and got["claim"], got
    # Allowed first: the live job's scratch is kept, and its claim with it.
    after = got["after_recovery"]
    assert after["a2"] and after["a2_claimed"], got
    assert not any(tid == "a2" and act == "scratch cleared" for tid, act, _d in got["actions"]), got
    # The left one, whose task holds no claim, is emptied by recovery, which says so.
    assert not after["a1"], got
    assert ["a1", "scratch cleared"] in [a[:2] for a in got["actions"]], got
    # gc of the rejected task empties its planted scratch through the backend, then removes its
    # job directories; the live job's scratch is still there.
    gcd = got["after_gc"]
    assert gcd["collected"] == ["a1"] and not gcd["a1_meta"], got
    assert '"scratch cleared"' in gcd["events"] and gcd["a2"], got
    # A retried task's next attempt (a3's planted scratch defeats the user's rm too) runs on a
    # cleared scratch, emptied by the job's meta directory, and its engine runs.
    retry = got["retry"]
    assert retry["planted_rm"] != 0, got
    second = retry["second"]
    assert second["attempt"] == 2 and second["exit_code"] == 3, (second.get("error"), retry["out"])
    assert second["workspace"]["strategy"] == "overlay" and not retry["left"], got

"""Narrowing only narrows: no limit a task or a policy sets reaches Docker as
0, "unlimited", "default" or above the policy. Generated task and policy files are either refused
as input (InvalidTaskFile / InvalidPolicy, exit 2) or give container limits that are all > 0 and
within the policy; one real container shows the cgroup a narrowing produces."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from fila.core.errors import InvalidPolicy, InvalidTaskFile
from fila.core.layout import Root
from fila.core.models import MIN_CPUS, MIN_MEMORY, MIN_PIDS, MIN_SIZE, Limits, Policy, Task, parse_size
from fila.engines.base import HOME
from fila.queue.policy import load_policy, narrow, validate_document
from fila.sandbox.docker import backend as sandbox
from fila.workspace.strategy import CopyWorkspace
from tests.support.cli import fila
from tests.support.project import make_root, record

SHIPPED = json.loads((Path(__file__).resolve().parents[1] / "policies" / "default.json").read_text())

# Values a hostile or careless file holds: Docker's "unlimited"/"default" spellings, floats that
# round to 0, overflowing sizes, bools where numbers go, strings where numbers go.
weird_size = st.one_of(
    st.builds(lambda n, u: f"{n}{u}", st.integers(6, 4096), st.sampled_from(["m", "M"])),
    st.sampled_from(["0", "0k", "0m", "0g", "", "-1", "1", "5m", "6m", "1k", "64m", "2g", "9999999999999g",
                     "00", " 64m", "64m\n", "64M", "1.5g", "64mb", "1e3", "0x40"]),
    st.from_regex(r"\A[0-9]{1,16}[kmgKMG]?\Z"),
    st.integers(-1, 1 << 70),
    st.booleans(),
    st.none(),
)  # fmt: skip
weird_float = st.one_of(
    st.floats(0.01, 8),
    st.sampled_from([0, 0.0, -0.0, 1e-12, 0.001, 0.0099, 0.01, 0.5, 1, 1.0, 2.0, -1.0, math.nan, math.inf]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.sampled_from(["0.5", "1", ""]),
)
weird_int = st.one_of(
    st.integers(4, 5_000_000),
    st.sampled_from([0, -1, 1, 3, 4, 50, 256, 1 << 31, 1 << 63, 1 << 64]),
    st.integers(-10, 1 << 66),
    st.booleans(),
    st.sampled_from([1.0, 50.0, "50", None]),
)


def _opt(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.just(None), strategy)  # None: the field is absent


limits_strategy = st.fixed_dictionaries(
    {}, optional={"memory": weird_size, "cpus": weird_float, "pids": weird_int}
)
policy_strategy = st.fixed_dictionaries(
    {"max_timeout_ms": weird_int, "default_timeout_ms": weird_int},
    optional={
        "grace_ms": weird_int,
        "memory": weird_size,
        "cpus": weird_float,
        "pids": weird_int,
        "nofile": weird_int,
        "fsize": weird_size,
        "tmpfs": st.fixed_dictionaries({}, optional={"tmp": weird_size, "home": weird_size}),
        "max_diff_bytes": weird_int,
        "max_log_bytes": weird_int,
        "max_work_bytes": weird_int,
        "max_work_files": weird_int,
        "max_consecutive_failures": weird_int,
        "network": st.sampled_from(["none", "bridge", "host", "container:x", "", "NONE"]),
        "runtime": st.sampled_from(
            [None, "runsc", "runc", "", "runc --privileged", "a;b", "io.containerd.runsc.v1", "x\n", "../x"]
        ),
    },
)  # fmt: skip


@pytest.fixture(scope="module")
def bare_root(tmp_path_factory: pytest.TempPathFactory) -> Root:
    return make_root(tmp_path_factory.mktemp("narrow"))


def _job_spec(root: Root, policy: Policy, task: Task) -> sandbox.RunSpec:
    job = root.path / "sandbox" / "jobs" / "j"
    (job / "input").mkdir(parents=True, exist_ok=True)
    (job / "work").mkdir(exist_ok=True)
    eff = narrow(policy, task, name="p")
    return sandbox.RunSpec(
        job_id="j", workspace=CopyWorkspace(job),
        image="fila/shell", argv=["/bin/sh", "-c", "true"], env={}, policy=policy,
        limits=eff.limits, timeout_ms=eff.timeout_ms, log_path=root.path / "j.log", labels={}, redact=[],
    )  # fmt: skip


def _container_limits(kw: dict[str, Any]) -> dict[str, int]:
    """Every number the container is limited by, as Docker receives it."""
    got = {
        "memory": kw["mem_limit"],
        "memswap": kw["memswap_limit"],
        "nano_cpus": kw["nano_cpus"],
        "pids": kw["pids_limit"],
    }
    for u in kw["ulimits"]:
        got[f"{u['Name']}.soft"], got[f"{u['Name']}.hard"] = u["Soft"], u["Hard"]
    for target, opts in kw["tmpfs"].items():
        got[f"tmpfs {target}"] = int(re.search(r"(?:^|,)size=([0-9]+)", opts).group(1))
    return got


def _caps(p: Policy) -> dict[str, int]:
    fsize = parse_size(p.fsize)
    return {
        "memory": parse_size(p.memory), "memswap": parse_size(p.memory), "nano_cpus": int(p.cpus * 1e9),
        "pids": p.pids, "nofile.soft": p.nofile, "nofile.hard": p.nofile, "fsize.soft": fsize,
        "fsize.hard": fsize, "tmpfs /tmp": parse_size(p.tmpfs.tmp),
        f"tmpfs {HOME}": parse_size(p.tmpfs.home),
    }  # fmt: skip


def _floors() -> dict[str, int]:
    return {
        "memory": MIN_MEMORY, "memswap": MIN_MEMORY, "nano_cpus": int(MIN_CPUS * 1e9), "pids": MIN_PIDS,
        "nofile.soft": 1, "nofile.hard": 1, "fsize.soft": MIN_SIZE, "fsize.hard": MIN_SIZE,
        "tmpfs /tmp": MIN_SIZE, f"tmpfs {HOME}": MIN_SIZE,
    }  # fmt: skip


def _accepted_task(data: dict[str, Any]) -> Task | None:
    """The task as submit and claim see it, or None when refused as input."""
    try:
        validate_document("task", data, path="generated")
        return Task.model_validate(data)
    except InvalidTaskFile:
        return None


def _assert_within(kw: dict[str, Any], policy: Policy) -> dict[str, int]:
    got, caps, floors = _container_limits(kw), _caps(policy), _floors()
    assert set(got) == set(caps), got
    for k, v in got.items():
        assert isinstance(v, int) and not isinstance(v, bool), (k, v)
        assert 0 < floors[k] <= v <= caps[k], (k, v, floors[k], caps[k])
    return got


DEFAULT = Policy.model_validate(SHIPPED)


@settings(max_examples=400, deadline=None)
@given(limits=limits_strategy)
@example(limits={"memory": "0"})  # the case: ran with no memory limit at all
@example(limits={"cpus": 1e-12})  # rounds to nano_cpus 0: Docker's "no limit"
@example(limits={"pids": True})  # JSON true is not 1
@example(limits={"memory": "9999999999999g"})
@example(limits={"memory": "64m", "cpus": 0.5, "pids": 50})
def test_generated_limits_are_refused_or_reach_docker_above_zero_and_within_the_policy(
    bare_root: Root, limits: dict
) -> None:
    # Allowed counterpart first: a real narrowing reaches Docker as asked.
    ok = _accepted_task({"engine": "shell", "targets": ["a"], "limits": {"memory": "64m", "pids": 50}})
    assert ok is not None
    got = _assert_within(sandbox.create_kwargs(_job_spec(bare_root, DEFAULT, ok), "n"), DEFAULT)
    assert got["memory"] == 64 << 20 and got["pids"] == 50 and got["nano_cpus"] == 1_000_000_000

    task = _accepted_task({"engine": "shell", "targets": ["a"], "limits": limits})
    if task is None:
        event("refused: invalid task file")
        return
    try:
        spec = _job_spec(bare_root, DEFAULT, task)
    except InvalidPolicy as e:  # asks for more than the policy: refused, never clipped
        assert "above" in str(e) and "limits." in str(e)
        event("refused: above the policy")
        return
    event("accepted")
    got = _assert_within(sandbox.create_kwargs(spec, "n"), DEFAULT)
    if limits.get("memory") is not None:
        assert got["memory"] == parse_size(limits["memory"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=policy_strategy, limits=limits_strategy)
@example(data={**SHIPPED, "tmpfs": {"tmp": "0", "home": "256m"}}, limits={})
@example(data={**SHIPPED, "fsize": "0"}, limits={})
@example(data={**SHIPPED, "nofile": 0}, limits={})
@example(data={**SHIPPED, "memory": "1m"}, limits={})
@example(data={**SHIPPED, "default_timeout_ms": 10, "max_timeout_ms": 5}, limits={})
@example(data={**SHIPPED, "runtime": "runc --privileged"}, limits={})
@example(data={**SHIPPED, "network": "host"}, limits={})
@example(data={**SHIPPED, "cpus": 0.001}, limits={})
def test_generated_policy_files_load_only_when_every_container_limit_is_real(
    bare_root: Root, data: dict, limits: dict
) -> None:
    """A policy file is input too: loaded (as a worker does) it is refused, or every container it
    runs is limited by exactly its fields (never weaker), and narrowing stays within them."""
    pfile = bare_root.policies_dir / "gen.json"
    pfile.write_text(json.dumps(SHIPPED))  # allowed counterpart: the shipped policy loads
    shipped, _ = load_policy(bare_root, "gen")
    assert shipped == DEFAULT

    pfile.write_text(json.dumps({k: v for k, v in data.items() if v is not None}, allow_nan=True))
    try:
        policy, _ = load_policy(bare_root, "gen")
    except InvalidPolicy as e:
        assert any(k in str(e) for k in data) or "JSON" in str(e), str(e)  # names the field
        event("policy refused")
        return
    event("policy accepted")
    assert policy.default_timeout_ms <= policy.max_timeout_ms and policy.network in (
        "none",
        "bridge",
        "allowlist",
    )
    assert policy.runtime is None or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", policy.runtime)
    plain = Task(engine="shell", targets=["a"])
    got = _assert_within(sandbox.create_kwargs(_job_spec(bare_root, policy, plain), "n"), policy)
    assert got == _caps(policy), "without a narrowing the container gets exactly the policy's fields"
    task = _accepted_task({"engine": "shell", "targets": ["a"], "limits": limits})
    if task is None:
        return
    try:
        spec = _job_spec(bare_root, policy, task)
    except InvalidPolicy:
        return
    _assert_within(sandbox.create_kwargs(spec, "n"), policy)


def test_the_last_check_before_docker_refuses_a_limit_the_models_did_not_see(
    bare_root: Root,
) -> None:
    """Defence in depth: a policy or task built in code skips validation (model_construct); what
    would reach Docker as 0 or above the policy is still refused."""
    task = Task(engine="shell", targets=["a"])
    _assert_within(sandbox.create_kwargs(_job_spec(bare_root, DEFAULT, task), "n"), DEFAULT)  # allowed
    weak = DEFAULT.model_copy(update={"memory": "0"})
    with pytest.raises(InvalidPolicy, match="container memory would be 0"):
        sandbox.create_kwargs(_job_spec(bare_root, weak, task), "n")
    tiny = DEFAULT.model_copy(update={"cpus": 1e-12})
    with pytest.raises(InvalidPolicy, match="container cpus would be 0"):
        sandbox.create_kwargs(_job_spec(bare_root, tiny, task), "n")
    no_tmp = DEFAULT.model_copy(update={"tmpfs": DEFAULT.tmpfs.model_copy(update={"tmp": "0"})})
    with pytest.raises(InvalidPolicy, match="tmpfs /tmp would be 0"):
        sandbox.create_kwargs(_job_spec(bare_root, no_tmp, task), "n")
    sneaky = Task.model_construct(
        engine="shell",
        targets=["a"],
        timeout=None,
        limits=Limits.model_construct(memory="0", cpus=None, pids=None),
    )
    with pytest.raises(InvalidTaskFile, match=r"limits\.memory"):
        narrow(DEFAULT, sneaky)


def _task_file(root: Root, name: str, limits: dict[str, Any], command: str = "true") -> Path:
    f = root.path / f"{name}.json"
    f.write_text(
        json.dumps({"engine": "shell", "command": command, "targets": ["greeting.txt"], "limits": limits})
    )
    return f


@pytest.mark.parametrize(
    ("limits", "field", "why"),
    [
        ({"memory": "0"}, "limits.memory", "0 bytes"),
        ({"memory": "5m"}, "limits.memory", "allowed 6m"),
        ({"memory": "9999999999999g"}, "limits.memory", "1024g"),
        ({"cpus": 0.001}, "limits.cpus", "0.01"),
        ({"cpus": 0}, "limits.cpus", "0.01"),
        ({"pids": 0}, "limits.pids", "4"),
        ({"pids": True}, "limits.pids", "True is not valid"),
        ({"memory": "4g"}, "limits.memory", "above"),
    ],
)
def test_submit_refuses_a_narrowing_that_widens_or_unlimits_naming_the_field(
    root: Root, limits: dict, field: str, why: str
) -> None:
    res = fila(root.path, "submit", str(_task_file(root, "ok", {"memory": "64m", "cpus": 0.5, "pids": 50})))
    assert res.exit_code == 0, res.output  # allowed counterpart
    res = fila(root.path, "submit", str(_task_file(root, "bad", limits)))
    assert res.exit_code == 2, res.output
    assert field in res.stderr and why in res.stderr, res.stderr


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tmpfs": {"tmp": "0", "home": "256m"}}, "tmpfs.tmp"),
        ({"fsize": "0"}, "fsize"),
        ({"nofile": 0}, "nofile"),
        ({"memory": "1m"}, "memory"),
        ({"default_timeout_ms": 2_000_000}, "default_timeout_ms"),
        ({"network": "host"}, "network"),
        ({"runtime": "runc --privileged"}, "runtime"),
        ({"cpus": 1e-12}, "cpus"),
        ({"pids": True}, "pids"),
        ({"projects": ["relative/dir"]}, "projects.0"),
    ],
)
def test_a_policy_weaker_than_its_fields_is_refused_at_submit_naming_the_field(
    root: Root, change: dict, field: str
) -> None:
    (root.policies_dir / "p.json").write_text(json.dumps(SHIPPED))
    res = fila(
        root.path, "submit", "--engine", "shell", "--command", "true", "-t", "greeting.txt", "--policy", "p"
    )
    assert res.exit_code == 0, res.output  # allowed counterpart: the same file, unchanged
    (root.policies_dir / "p.json").write_text(json.dumps({**SHIPPED, **change}))
    res = fila(
        root.path, "submit", "--engine", "shell", "--command", "true", "-t", "greeting.txt", "--policy", "p"
    )
    assert res.exit_code == 2, res.output
    assert f"'{field}'" in res.stderr or f"{field} " in res.stderr, res.stderr


@pytest.mark.docker
def test_a_narrowing_reaches_the_cgroup_and_zero_never_does(
    root: Root, shell_image: Any, started_containers: Any
):
    """The real thing: the cgroup inside the container (v1 here, v2 elsewhere) holds the narrowed
    values; a "0" is refused at submit, and dropped into fila/in, at claim, with no container."""
    probe = (
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max; "
        "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max"
    )
    res = fila(root.path, "submit", str(_task_file(root, "ok", {"memory": "64m", "pids": 50}, probe)))
    assert res.exit_code == 0, res.output
    ok = res.stdout.strip()
    res = fila(root.path, "submit", str(_task_file(root, "zero", {"memory": "0"}, probe)))
    assert res.exit_code == 2 and "limits.memory" in res.stderr, res.output
    dropped = root.in_dir / "dropped-zero.json"
    dropped.write_text(json.dumps({"engine": "shell", "command": probe, "targets": ["greeting.txt"],
                                   "limits": {"memory": "0"}}))  # fmt: skip
    res = fila(root.path, "run", "--once")
    assert record(root.path, ok)["status"] == "needs_review", res.output
    shown = (root.logs_dir / f"{ok}.log").read_text().split()
    assert shown[:2] == [str(64 << 20), "50"], shown
    rec = record(root.path, "dropped-zero")
    assert rec["status"] == "failed" and rec["error"]["kind"] == "invalid", rec
    assert "limits.memory" in rec["error"]["message"]
    assert started_containers.count() == 1, "only the allowed task ran a container"


@pytest.mark.docker
def test_a_task_queued_before_the_floors_is_refused_at_claim_and_its_record_still_reads(
    root: Root, shell_image: Any, started_containers: Any
) -> None:
    """A record is history: one written by an older fila (memory "0" was accepted then) still
    loads for ls and show, and its task never runs with the unlimited value."""
    res = fila(root.path, "submit", str(_task_file(root, "ok", {"memory": "64m"})))
    assert res.exit_code == 0, res.output
    ok = res.stdout.strip()
    res = fila(root.path, "submit", str(_task_file(root, "old", {"memory": "64m"})))
    old = res.stdout.strip()
    for path in (root.record_path(old), root.queued_path(old)):  # as an older fila wrote them
        data = json.loads(path.read_text())
        data.get("task", data)["limits"] = {"memory": "0"}
        path.write_text(json.dumps(data))
    assert old in fila(root.path, "ls").stdout and fila(root.path, "show", old).exit_code == 0
    fila(root.path, "run", "--once")
    assert record(root.path, ok)["status"] == "needs_review"
    rec = record(root.path, old)
    assert rec["status"] == "failed" and rec["error"]["kind"] == "invalid", rec
    assert "limits.memory" in rec["error"]["message"]
    assert started_containers.count() == 1, "only the valid task started a container"
    assert fila(root.path, "show", old).exit_code == 0

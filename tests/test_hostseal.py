"""The host's seal of a build's bridge (sandbox/docker/hostseal.py): a killed build's leftover
rules are found by their tag and removed once their bridge is gone; a live bridge's are kept."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fila.sandbox.docker import hostseal

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in (*hostseal.TOOLS, "ip")),
    reason="the seal is root's, with iptables",
)


def _rules() -> str:
    return subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True, check=True).stdout


def _rule(action: str, bridge: str, check: bool = True) -> None:
    comment = f"{hostseal.COMMENT_PREFIX}:test-{bridge}"
    for tool in hostseal.TOOLS:
        spec = ["INPUT", "-i", bridge, "-m", "comment", "--comment", comment, "-j", "DROP"]
        subprocess.run([tool, "-w", "5", action, *spec], check=check, capture_output=True)


def test_a_gone_bridges_seal_is_removed_and_a_live_ones_kept() -> None:
    # A bridge of the test's own stands for a live build's: its rule drops nothing anyone uses.
    gone, live = "br-filagone01", "filalive01"
    subprocess.run(["ip", "link", "add", "name", live, "type", "bridge"], check=True)
    try:
        _rule("-I", gone)
        _rule("-I", live)
        assert f"test-{gone}" in _rules() and f"test-{live}" in _rules()
        removed = hostseal.remove_stale()
        assert any(gone in r for r in removed) and not any(live in r for r in removed), removed
        assert f"test-{gone}" not in _rules() and f"test-{live}" in _rules()
    finally:
        _rule("-D", gone, check=False)
        _rule("-D", live, check=False)
        subprocess.run(["ip", "link", "del", live], check=False)


@pytest.mark.skipif(not hostseal.PIDS_ROOT.is_dir(), reason="cgroup v1's pids hierarchy")
def test_a_killed_builds_cgroup_is_removed_and_a_live_ones_and_another_roots_kept(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    made = {
        "gone": hostseal.PIDS_ROOT / hostseal.cgroup_name(mine, "job-gone"),
        "live": hostseal.PIDS_ROOT / hostseal.cgroup_name(mine, "job-live"),
        "other": hostseal.PIDS_ROOT / hostseal.cgroup_name(other, "job-gone"),
    }
    for path in made.values():
        path.mkdir()
    try:
        removed = hostseal.remove_stale_cgroups(mine, lambda job: job == "job-live")
        assert removed == [f"cgroup {made['gone']}"], removed
        assert not made["gone"].exists() and made["live"].exists() and made["other"].exists()
    finally:
        for path in made.values():
            if path.exists():
                path.rmdir()

"""The host's seal of a build's bridge (sandbox/docker/hostseal.py): a killed build's leftover
rules are found by their tag and removed once their bridge is gone; a live bridge's are kept."""

from __future__ import annotations

import os
import shutil
import subprocess

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

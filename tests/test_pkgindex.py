"""The local package indexes of the environment tests (tests/support/pkgindex.py): from a
fila/testenv container on their sealed network, pip and npm install what the indexes hold, a name
they do not hold is refused (no fallback to a public registry), and nothing outside answers."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.support.pkgindex import NPM, PYPI, PkgIndex
from tests.upstreams.fixtures import OUTSIDE

pytestmark = [pytest.mark.docker, pytest.mark.slow]

NODE_PROJECT = {
    "package.json": json.dumps(
        {
            "name": "tiny",
            "version": "1.0.0",
            "private": True,
            "scripts": {"test": "uvu tests"},
            "dependencies": {"ms": "^2.1.3"},
            "devDependencies": {"uvu": "^0.5.6"},
        }
    ),
    "tests/ms.js": (
        "const { test } = require('uvu');\n"
        "const assert = require('uvu/assert');\n"
        "const ms = require('ms');\n"
        "test('two seconds', () => { assert.is(ms('2s'), 2000); });\n"
        "test.run();\n"
    ),
}


def _write_files(files: dict[str, str], into: str) -> str:
    """A shell fragment writing `files` under `into` (the client's tmpfs home)."""
    parts = []
    for rel, text in files.items():
        path = f"{into}/{rel}"
        parts.append(f"mkdir -p $(dirname {path}) && printf %s {shlex.quote(text)} > {path}")
    return " && ".join(parts)


def test_pip_installs_pytest_from_pypi_test_and_finds_nothing_it_does_not_hold(pkgindex: PkgIndex) -> None:
    res = pkgindex.run(
        "python3 -m venv /home/fila/venv && cd /home/fila && "
        "venv/bin/pip install --no-cache-dir pytest six && venv/bin/python -m pytest --version && "
        # requests is on PyPI, not on pypi.test: pypiserver answers 404, never redirects to PyPI.
        "! venv/bin/pip download --no-cache-dir -d dl requests",
        env=pkgindex.pip_env,
    )
    assert res.exit_code == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Successfully installed" in res.stdout and "pytest-9.2.0" in res.stdout
    assert "No matching distribution found for requests" in res.stderr
    # Answered here, a 404: not a redirect to PyPI (pypiserver's fallback, turned off).
    missing = '"GET /simple/requests/ HTTP/1.1" 404'
    log = pkgindex.logged(PYPI, '"GET /simple/pytest/ HTTP/1.1" 200', missing)
    assert '"GET /simple/pytest/ HTTP/1.1" 200' in log and missing in log, log[-3000:]


def test_npm_installs_a_seeded_test_runner_from_npm_test_and_npm_test_runs(pkgindex: PkgIndex) -> None:
    res = pkgindex.run(
        _write_files(NODE_PROJECT, "/home/fila/tiny")
        + " && cd /home/fila/tiny && npm install && npm test"
        # left-pad is on the public registry, not on npm.test: a 404, no uplink asked.
        + " && ! npm view left-pad version",
        env=pkgindex.npm_env,
    )
    assert res.exit_code == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Total:     1" in res.stdout and "Passed:    1" in res.stdout
    assert "E404" in res.stderr
    # Answered from verdaccio's own storage: no uplink to ask.
    log = pkgindex.logged(NPM, "req: 'GET /uvu/-/uvu-0.5.6.tgz'", "req: 'GET /left-pad'")
    left_pad = [line for line in log.splitlines() if "req: 'GET /left-pad'" in line]
    refused = [line for line in left_pad if line.startswith("http <-- 404") and "no such package" in line]
    assert refused, log[-3000:]
    assert "req: 'GET /uvu/-/uvu-0.5.6.tgz', bytes: 0/11146" in log, log[-3000:]


def test_the_indexes_network_has_no_route_out(pkgindex: PkgIndex) -> None:
    # The allowed counterpart first, from the same container: the index answers on its name.
    probe = (
        "import socket, sys\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "def knock(target):\n"
        "    host, port = target.rsplit(':', 1)\n"
        "    try:\n"
        "        socket.create_connection((host, int(port)), timeout=5).close()\n"
        "        return host + ' connected'\n"
        "    except OSError as e:\n"
        "        return f'{host} failed {e}'\n"
        "with ThreadPoolExecutor(8) as ex:\n"
        "    print('\\n'.join(ex.map(knock, sys.argv[1:])))\n"
    )
    targets = [f"{PYPI}:{pkgindex.pypi.port}", f"{NPM}:{pkgindex.npm.port}"]
    targets += [f"{o}:{port}" for o in OUTSIDE for port in (80, 443)]
    res = pkgindex.run(f"python3 -c {shlex.quote(probe)} {' '.join(targets)}")
    assert res.exit_code == 0, res.stderr
    seen = [line.split(" ", 1) for line in res.stdout.splitlines()]
    assert [(h, r) for h, r in seen if h in (PYPI, NPM)] == [(PYPI, "connected"), (NPM, "connected")], seen
    outside = [r for h, r in seen if h in OUTSIDE]
    assert len(outside) == 2 * len(OUTSIDE) and all(r.startswith("failed") for r in outside), seen

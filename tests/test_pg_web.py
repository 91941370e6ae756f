"""`fila serve --queue URL`: the review queue of a PostgreSQL queue in the browser's terms (HTTP
through Starlette's TestClient), on a real server (tests/support/pg.py) with a fake-backend
runner. The reviewer's page lists the database's tasks, shows a task's verified patch, and its
apply lands in the serving root and is recorded in the database by the account's name, for
every other reader of the queue."""

from __future__ import annotations

from pathlib import Path

import pytest

from fila.core.models import Status
from fila.queue.pg.store import PgQueue
from fila.web import accounts
from tests.support.pg_runner import fila, host_env
from tests.support.project import GREETING, make_project, make_root
from tests.support.web import apply_form, chromium, client, live_server, log_in, login

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
ORIGIN = {"Origin": "http://127.0.0.1"}


def test_a_postgresql_queue_is_reviewed_and_decided_over_http(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = make_project(tmp_path / "submitter")
    for tid, command, prompt in [("p1", "echo bye >> greeting.txt", "say bye <b>now</b>"),
                                 ("p2", "echo other >> greeting.txt", "other words")]:  # fmt: skip
        res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
                   "--command", command, "--prompt", prompt, "-t", "greeting.txt")  # fmt: skip
        assert res.exit_code == 0, res.output
    runner = make_root(tmp_path / "runner")
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once")
    assert res.exit_code == 0, res.output
    alice = make_project(tmp_path / "alice")
    _, token = accounts.add(alice, "alice")
    with PgQueue(pg_url) as db:
        c = client(alice, db=db)
        assert login(c, "alice", token).status_code == 303
        got = c.get("/api/tasks", params={"q": "bye"}).json()
        assert [r["id"] for r in got["rows"]] == ["p1"] and got["counts"]["needs_review"] == 2
        assert "&lt;b&gt;now&lt;/b&gt;" in c.get("/").text
        page = c.get("/task/p1")
        assert page.status_code == 200 and "+bye" in page.text and "PostgreSQL queue" in page.text
        assert c.get("/task/nope").status_code == 404 and c.get("/task/%2e%2e").status_code == 400
        r = c.post("/task/p1/apply", data=apply_form(page.text), headers=ORIGIN)
        assert r.status_code == 303, r.text
        assert (alice.path / "greeting.txt").read_text() == GREETING + "bye\n"
        assert (sub.path / "greeting.txt").read_text() == GREETING
        assert not alice.job_dir("p1").exists()  # the copy apply laid out is gone
    with PgQueue(pg_url) as other:  # another reader of the queue sees the decision
        rec = other.get("p1")
        assert rec.status == Status.applied and rec.decision is not None and rec.decision.by == "alice"
        assert other.get("p2").status == Status.needs_review
    shown = fila("show", "p1", "--queue", pg_url)
    assert "decision:  applied by alice" in shown.output


def test_a_postgresql_queue_in_a_real_browser(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The browser flow on the PostgreSQL queue: log in, open the task, read its diff, apply it;
    the serving root changes and the database records the account."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    sub = make_project(tmp_path / "submitter")
    res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", "b1", "--engine", "shell",
               "--command", "echo browser >> greeting.txt", "-t", "greeting.txt")  # fmt: skip
    assert res.exit_code == 0, res.output
    runner = make_root(tmp_path / "runner")
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    assert (
        fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once").exit_code
        == 0
    )
    bob = make_project(tmp_path / "bob")
    _, token = accounts.add(bob, "bob")
    with PgQueue(pg_url) as db, live_server(bob, db) as (url, _first), chromium() as browser:
        log_in(browser, url, "bob", token)
        browser.find_element(By.LINK_TEXT, "b1").click()
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.ID, "diff"))
        assert "+browser" in browser.find_element(By.ID, "diff").text
        browser.find_element(By.ID, "apply").click()
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.ID, "notice"))
        assert browser.find_element(By.ID, "status").text == "applied"
    assert (bob.path / "greeting.txt").read_text() == GREETING + "browser\n"
    with PgQueue(pg_url) as q:
        d = q.get("b1").decision
        assert d is not None and d.by == "bob"

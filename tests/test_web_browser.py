"""`fila serve` in a real browser: Debian's headless Chromium, driven by Selenium, against the real
server (uvicorn on 127.0.0.1). The one-time login link opens it without accounts; a reviewer logs
in, filters the list, opens a task, reads its diff and applies it; the project changes on disk and
the record names her; a decision taken elsewhere and a new task reach the open pages without a
reload. The run saves the README's screenshot (docs/review-in-a-browser.png). scripts/browser-up
installs chromium and chromium-driver (scripts/test runs it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fila.core.layout import Root
from fila.web import accounts
from tests.support.cli import fila
from tests.support.project import make_project, record
from tests.support.web import chromium, live_server, log_in, make_task

SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "review-in-a-browser.png"
WAIT_S = 30  # an upper bound for the page's polling (every 3 s) to show a change, not a measure


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return make_project(tmp_path / "proj", {"src/app.py": "def greet():\n    return 'hello'\n"})


def test_a_reviewer_logs_in_filters_reads_the_diff_and_applies(root: Root, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    other = make_task(root, "echo bye > greeting.txt", prompt="say goodbye instead")
    tid = make_task(
        root,
        "printf 'hello, world\\n' > greeting.txt; sed -i \"s/'hello'/'hello, world'/\" src/app.py",
        "greeting.txt",
        "src",
        prompt="Greet the whole world, in the greeting and in app.py",
    )
    wait = WebDriverWait(browser, WAIT_S)
    with live_server(root) as (url, first):
        # Without accounts: the one-time link `fila serve` printed makes the person's session.
        assert first.startswith("/login/local?secret=")
        browser.get(url + "/")
        assert browser.current_url.endswith("/login") and browser.find_elements(By.ID, "local-only")
        browser.get(url + first)
        wait.until(lambda d: d.find_elements(By.ID, "tasks"))
        assert "(reviewer, local)" in browser.find_element(By.CLASS_NAME, "who").text
        # Once an account exists, that session ends (the same browser, its cookie) and a login
        # is needed.
        _, token = accounts.add(root, "alice")
        log_in(browser, url, "alice", token)
        rows = browser.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")
        assert len(rows) == 2
        browser.find_element(By.ID, "f-q").send_keys("whole world")
        browser.find_element(By.ID, "f-go").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")) == 1)
        browser.find_element(By.LINK_TEXT, tid).click()
        wait.until(lambda d: d.find_elements(By.ID, "diff"))
        diff = browser.find_element(By.ID, "diff").text
        assert "+hello, world" in diff and "-hello" in diff and '"src/app.py" (modified)' in diff
        assert "return 'hello, world'" in diff
        SCREENSHOT.parent.mkdir(exist_ok=True)
        browser.save_screenshot(str(SCREENSHOT))
        browser.find_element(By.ID, "apply").click()
        wait.until(lambda d: d.find_elements(By.ID, "notice"))
        assert "applied to" in browser.find_element(By.ID, "notice").text
        assert browser.find_element(By.ID, "status").text == "applied"
        assert (root.path / "greeting.txt").read_text() == "hello, world\n"
        assert "'hello, world'" in (root.path / "src" / "app.py").read_text()
        d = record(root, tid)["decision"]
        assert (d["action"], d["by"]) == ("applied", "alice")
        # Another reviewer's decision reaches the open page without a reload.
        browser.get(f"{url}/task/{other}")
        wait.until(lambda d: d.find_element(By.ID, "status").text == "needs_review")
        marker = browser.find_element(By.ID, "apply-form")
        assert fila(root, "reject", other, "--by", "bob", "--reason", "not now").exit_code == 0
        wait.until(lambda d: d.find_element(By.ID, "status").text == "rejected")
        assert "rejected by bob" in browser.find_element(By.ID, "decision").text
        assert not marker.is_displayed()  # the same page (no reload): its apply form hidden
        # A new task reaches the open list without a reload.
        browser.get(url + "/")
        first = browser.find_element(By.ID, "tasks")
        new = make_task(root, "echo new > greeting.txt", prompt="a late task")
        wait.until(lambda d: new in d.find_element(By.ID, "tasks").text)
        assert first == browser.find_element(By.ID, "tasks")

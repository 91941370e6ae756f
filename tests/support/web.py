"""`fila serve` in tests: tasks made quickly with the fake backend (no container: the review is the
point here, not the sandbox), the app under Starlette's TestClient, and the real server (uvicorn
on 127.0.0.1, a free port) in a thread for a browser."""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fila.core.layout import Root
from fila.web import accounts
from fila.web.app import Config, make_app
from fila.web.server import Bind, server
from fila.web.sessions import Throttle
from tests.support.cli import run_shell

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
SHA256 = re.compile(r'name="sha256" value="([^"]*)"')


def fake_env(root: Root) -> dict[str, str]:
    return {"FILA_BACKEND": "fake", "FILA_FAKE_DIR": str(root.path.parent / f"{root.path.name}.boxes")}


def make_task(
    root: Root,
    command: str,
    *targets: str,
    prompt: str = "",
    status: str = "needs_review",
    extra: tuple[str, ...] = (),
) -> str:
    """A shell task run by the fake backend (its command on the host, in work/): its id, once its
    record says `status`. `extra`: more options of `fila submit`."""
    more = ("--prompt", prompt) if prompt else ()
    return run_shell(root, command, *targets, status=status, extra=(*more, *extra), env=fake_env(root))


def client(
    root: Root,
    *,
    https: bool = False,
    throttle: Throttle | None = None,
    db: Any = None,
    local: bool = True,
    app: Any = None,
    public_origin: str | None = None,
) -> Any:
    """A TestClient of the app on `root` (or another browser of `app`), as a browser on this host
    reaches it (Host 127.0.0.1). Without accounts and with `local`, it has opened the server's
    one-time login link (what the person who starts `fila serve` does); `c.app_config` is the
    Config of the app it made."""
    from starlette.testclient import TestClient

    cfg = Config(
        root=root,
        db=db,
        loopback=True,
        throttle=throttle or Throttle(base_delay_s=0.0),
        public_origin=public_origin,
    )
    base = f"{'https' if https else 'http'}://127.0.0.1"
    c = TestClient(app or make_app(cfg), base_url=base, follow_redirects=False)
    c.app_config = cfg if app is None else None
    if app is None and local and not accounts.any_active(root):
        assert c.get(cfg.local_link).status_code == 303
    return c


def csrf(html: str) -> str:
    m = CSRF.search(html)
    assert m, "no CSRF token in the page"
    return m[1]


def apply_form(html: str, **more: str) -> dict[str, str]:
    """The apply form of a task's page as a browser sends it: its CSRF token and the sha256 of
    the patch the page showed (empty when the page has no apply form)."""
    m = SHA256.search(html)
    return {"csrf": csrf(html), "sha256": m[1] if m else "", **more}


def login(c: Any, name: str, token: str) -> Any:
    page = c.get("/login")
    return c.post(
        "/login",
        data={"csrf": csrf(page.text), "name": name, "token": token},
        headers={"Origin": str(c.base_url).rstrip("/")},
    )


@contextlib.contextmanager
def live_server(root: Root, db: Any = None) -> Iterator[tuple[str, str]]:
    """The real server (uvicorn) on 127.0.0.1 and a free port, in a thread: its base URL and the
    path a person opens first (the one-time login link when there is no account, else `/`)."""
    srv, first = server(root, db, Bind("127.0.0.1", 0))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert t.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", first
    finally:
        srv.should_exit = True
        t.join(30)


def project_file(root: Root, rel: str) -> str:
    return Path(root.path / rel).read_text()


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's headless Chromium under Selenium (scripts/browser-up installs both; nothing is
    downloaded at run time)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path, binary = shutil.which("chromedriver"), shutil.which("chromium")
    assert driver_path and binary, "no chromium/chromedriver: run scripts/browser-up (as root)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--no-first-run", "--disable-extensions"):  # fmt: skip
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def log_in(driver: Any, url: str, name: str, token: str) -> None:
    """The login form, filled and sent; returns once the list is shown."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "/")
    assert driver.current_url.endswith("/login")
    driver.find_element(By.ID, "name").send_keys(name)
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "login").click()
    WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.ID, "tasks"))

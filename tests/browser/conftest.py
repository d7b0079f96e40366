"""Fixtures of the browser tests: Debian's headless Chromium driven by playwright-python, screenshots.

The browser is the system one (`apt-get install chromium chromium-driver`), launched through its
executable path: nothing is downloaded (`playwright install` is never needed). Screenshots go to
$TEST_ARTIFACTS when it is set, else to test-artifacts/browser/ in the checkout (gitignored).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.db import connections

if TYPE_CHECKING:
    from playwright.sync_api import ConsoleMessage, Page, Response

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
SKIP_REASON = "Chromium is not installed: apt-get install chromium chromium-driver (Debian package `chromium`)"
# Headless, and quiet: without the background-networking flags Chromium keeps calling Google
# services, which on a machine without internet only costs time.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT_PREFIX = "admin-console-"


def artifacts_dir() -> Path:
    """Where screenshots go: $TEST_ARTIFACTS, else <repo>/test-artifacts/browser/ (created)."""
    configured = os.environ.get("TEST_ARTIFACTS")
    path = Path(configured) if configured else ROOT / "test-artifacts" / "browser"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class BrowserSession:
    """A Chromium page with what went wrong in it (console errors, uncaught exceptions, HTTP errors)
    and numbered screenshots of the steps a test walks through."""

    page: Page
    folder: Path
    errors: list[str] = field(default_factory=list)
    screenshots: list[Path] = field(default_factory=list)

    def screenshot(self, name: str) -> Path:
        """Save a full-page screenshot as <folder>/admin-console-NN-<name>.png and return its path."""
        path = self.folder / f"{SCREENSHOT_PREFIX}{len(self.screenshots) + 1:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        self.screenshots.append(path)
        return path

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """One step of a test: screenshot after it (suffixed -FAILED when it raised), and fail it when
        the page logged a JavaScript error meanwhile."""
        before = len(self.errors)
        try:
            yield
        except BaseException:
            self.screenshot(f"{name}-FAILED")
            raise
        self.screenshot(name)
        new = self.errors[before:]
        assert not new, f"step {name!r}: the browser reported errors:\n" + "\n".join(new)

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            where = message.location
            self.errors.append(f"console: {message.text} ({where.get('url')}:{where.get('lineNumber')})")

    def _on_page_error(self, error: Exception) -> None:
        self.errors.append(f"uncaught: {error}")

    def _on_response(self, response: Response) -> None:
        if response.status >= 400:
            self.errors.append(f"HTTP {response.status} {response.request.method} {response.url}")

    def watch(self) -> None:
        """Record console errors, uncaught exceptions and HTTP error answers of the page."""
        self.page.on("console", self._on_console)
        self.page.on("pageerror", self._on_page_error)
        self.page.on("response", self._on_response)


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BrowserSession]:
    """A headless Chromium page (fresh profile, 1400×900 viewport) watched for errors.

    playwright's sync API keeps its event loop marked as running in the test's thread, which Django
    takes for an async context: (1) it refuses ORM calls there, although they are plain synchronous
    ones, so DJANGO_ALLOW_ASYNC_UNSAFE is set for this test only; (2) the database connections opened
    meanwhile are kept apart from the thread's usual ones (asgiref's Local is per-context while a loop
    runs), so pytest-django's teardown would not close them and could not drop the PostgreSQL test
    database: they are closed here while the loop still counts as running.
    """
    if not CHROMIUM.exists():
        pytest.skip(SKIP_REASON)
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    folder = artifacts_dir()
    for stale in folder.glob(f"{SCREENSHOT_PREFIX}*.png"):
        stale.unlink()
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900},
            timezone_id="UTC",
            locale="en-US",
        )
        try:
            # The admin links no favicon; Chromium's own guess at /favicon.ico would be a 404 "error".
            context.route("**/favicon.ico", lambda route: route.fulfill(status=204))
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(10_000)
            session = BrowserSession(page=page, folder=folder)
            session.watch()
            yield session
        finally:
            connections.close_all()  # those of the test and fixtures that ran while the loop "ran"
            context.close()

"""Debian's chromium driven by Playwright, for the tests that need a real browser.

``.ci/run`` installs chromium and sets CONVEYOR_REQUIRE_BROWSER=1, so there a missing browser fails
the run; elsewhere a module that imports this is skipped with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

CHROMIUM = "/usr/bin/chromium"
LAUNCH_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]

if not os.path.exists(CHROMIUM):
    if os.environ.get("CONVEYOR_REQUIRE_BROWSER"):
        raise RuntimeError(f"{CHROMIUM} is missing: apt-get install chromium")
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)", allow_module_level=True)

from playwright.sync_api import sync_playwright  # noqa: E402


@contextmanager
def launched() -> Iterator:
    """A headless chromium for the block."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def browser():
    with launched() as b:
        yield b

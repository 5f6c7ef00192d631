"""What the browser tests share (a pytest plugin, loaded by conftest.py): a real JupyterLab beside the test's
broker, a real headless Chromium page on it, and helpers to find the sidebar's parts."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab_server import LabServer

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
WAIT_MS = 60_000  # bounds for conditions to appear (not timings we assert)


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here (None when they can: Chromium is there, or root installs it)."""
    if not os.path.exists(CHROMIUM) and os.geteuid() != 0:
        return (f"{CHROMIUM} is missing and we are not root to install it: run `make system-deps` as root "
                "(apt-get install chromium)")
    return None


@pytest.fixture
def lab(broker, tmp_path) -> Iterator[LabServer]:
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: run `make system-deps` (apt-get install chromium)"
    server = LabServer(tmp_path / "lab", env={
        "GPULEASE_BROKER": broker.url,
        "GPULEASE_ARTIFACT_ROOT": str(tmp_path / "lab" / "root" / "gpulease-artifacts"),
    }).start()
    yield server
    server.stop()


@pytest.fixture
def page(lab: LabServer, request) -> Iterator[Any]:
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(WAIT_MS)
        yield page
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-final.png"))
        browser.close()


def wait_until(condition, timeout: float = 30.0) -> bool:
    """Poll a condition on a real process (bounded); True once it holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


def open_panel(page, lab: LabServer) -> None:

    page.goto(f"{lab.url}/lab?token={lab.token}")
    page.wait_for_selector("#jupyterlab-splash", state="detached")
    show_panel(page)


def show_panel(page) -> None:
    """Show the sidebar: its tab is clicked only when it is not shown yet (the ``openAtStart`` setting may have
    opened it already, and a click on the tab of a shown panel collapses it)."""
    from playwright.sync_api import expect

    tab = page.locator('.jp-SideBar.jp-mod-left li[data-id="gpulease-panel"]')
    expect(tab).to_be_visible()
    if not page.locator("#gpulease-panel").is_visible():
        tab.click()
    expect(page.locator("#gpulease-panel")).to_be_visible()


def card(page, gpu_id: str):
    return page.locator(f'#gpulease-panel .jp-GpuLease-card[data-gpu-id="{gpu_id}"]')


def lease_row(page, lease_id: str, section: str = "my-leases"):
    return page.locator(f'#gpulease-panel [data-section="{section}"] [data-lease-id="{lease_id}"]')


def status_item(page):
    return page.locator(".jp-GpuLease-statusItem")


def toast(page, text: str):
    """A JupyterLab notification that contains ``text``."""
    return page.locator(".Toastify__toast", has_text=text)


#: ``make screenshots`` sets it: the browser tests also write the pictures the docs show (``docs=``), from the real UI
DOCS_IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"


def screenshot(page, name: str, docs: str = "") -> None:
    """A picture of the page in the test artifacts; with ``docs`` and GPULEASE_UPDATE_DOCS_IMAGES=1, also the docs'
    picture of that name (the README's sidebar)."""
    if docs and os.environ.get("GPULEASE_UPDATE_DOCS_IMAGES") == "1":
        page.screenshot(path=str(DOCS_IMAGES / docs))
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))

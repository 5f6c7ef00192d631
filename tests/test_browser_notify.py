"""JupyterLab notifications about your own leases (issue 19), in a real JupyterLab in real headless Chromium against
a real broker: a queued %%gpu cell of another notebook is granted while you work in a first one, and you are told,
with a button that opens its notebook at the cell; a kind turned off in the settings is not told; while the tab is
hidden the browser's desktop notifications tell it too."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import nbformat
import pytest
from browser_support import CHROMIUM, WAIT_MS, chromium_missing, open_panel, screenshot, toast, wait_until

if why := chromium_missing():
    pytest.skip(why, allow_module_level=True)

from playwright.sync_api import expect, sync_playwright

pytestmark = pytest.mark.browser

PLUGIN = "jupyter-gpulease:plugin"

# Records what the page asks of the browser's real Notification API (the real constructor and requestPermission
# still run): the desktop notifications shown and the permission requests.
RECORD_DESKTOP = """
(() => {
  const Real = window.Notification;
  const shown = (window.__desktopShown = []);
  const asked = (window.__permissionAsked = []);
  class Recorded extends Real {
    constructor(title, options) {
      super(title, options);
      shown.push({ title, body: (options || {}).body || '' });
    }
  }
  Recorded.requestPermission = (...args) => {
    asked.push(Real.permission);
    return Real.requestPermission(...args);
  };
  window.Notification = Recorded;
})();
"""

# Headless Chromium reports every page visible, whatever is in front (checked: other tabs, minimised windows), so
# the test says when the tab counts as hidden, the one thing a headless browser cannot do itself.
HIDDEN_WHEN_ASKED = """
Object.defineProperty(Document.prototype, 'visibilityState', {
  configurable: true,
  get() { return window.__tabHidden ? 'hidden' : 'visible'; }
});
"""


@pytest.fixture
def broker(broker_factory, request):
    """One simulated GPU: a second request waits in the queue."""
    return broker_factory(gpus=1, args=["--tick=0.1", *getattr(request, "param", [])])


def put_settings(lab, values: dict[str, Any]) -> None:
    """Save user settings of the extension as the Settings Editor does (Lab's settings API)."""
    req = urllib.request.Request(f"{lab.url}/lab/api/settings/{PLUGIN}", method="PUT",
                                 data=json.dumps({"raw": json.dumps(values)}).encode(),
                                 headers={"Authorization": f"token {lab.token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status in (200, 204)


def write_notebook(lab, name: str, sources: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, lab.root_dir / name)


def current_tab(page):
    return page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")


def test_a_queued_cell_of_another_notebook_is_told_with_a_button_that_opens_it(lab, page, client):
    page.add_init_script(RECORD_DESKTOP)
    write_notebook(lab, "first.ipynb", ["x = 1"])
    write_notebook(lab, "second.ipynb", ["%load_ext jupyter_gpulease",
                                         "x = 'a prompt left from an earlier kernel'",
                                         "%%gpu --time 10m\nimport time; time.sleep(2)\nprint('granted at once')",
                                         "%%gpu --time 10m\nprint('the cell got its GPU', flush=True)"])
    nb = nbformat.read(lab.root_dir / "second.ipynb", as_version=4)
    nb.cells[1].execution_count = 3  # the prompt the last cell will get: "Open" must not select this one
    nbformat.write(nb, lab.root_dir / "second.ipynb")

    page.goto(f"{lab.url}/lab/tree/second.ipynb?token={lab.token}")
    page.wait_for_selector("#jupyterlab-splash", state="detached")
    expect(page.locator(".jp-StatusBar-Widget", has_text="Python 3 (ipykernel) | Idle").first).to_be_visible()
    cells = page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")
    cells.first.click()
    page.keyboard.press("Shift+Enter")
    expect(cells.first.locator(".jp-InputPrompt")).to_have_text("[1]:")

    # a %%gpu cell granted at once did not wait: no "waits in the queue", nor an offer of desktop notifications
    cells.nth(2).click()
    page.keyboard.press("Shift+Enter")
    expect(cells.nth(2).locator(".jp-OutputArea-output", has_text="granted at once")).to_be_visible()
    expect(cells.nth(2).locator(".jp-InputPrompt")).to_have_text("[2]:")
    expect(toast(page, "Your GPU request waits in the queue")).to_have_count(0)

    held = client.request_lease(1, heartbeat=False)
    assert held.state == "granted"
    page.keyboard.press("Shift+Enter")  # the last %%gpu cell waits in the queue: the only GPU is held
    assert wait_until(lambda: any(x.state == "queued" and x.labels.get("notebook", "").endswith("/second.ipynb")
                                  for x in client.leases()), 60), "the %%gpu cell's request is queued"

    # the first time a request of yours waits, desktop notifications are offered (a button: a user gesture)
    offer = toast(page, "Your GPU request waits in the queue")
    expect(offer).to_contain_text("Allow desktop notifications to be told")
    offer.get_by_role("button", name="Allow desktop notifications").click()
    assert wait_until(lambda: page.evaluate("window.__permissionAsked.length") == 1), "the browser was asked"
    assert page.evaluate("window.__permissionAsked") == ["default"]

    # work in the first notebook meanwhile
    if not page.locator("#filebrowser").is_visible():  # open with the notebook, or not (the workspace's choice)
        page.click('.jp-SideBar.jp-mod-left li[data-id="filebrowser"]')
    page.locator(".jp-DirListing-itemText", has_text="first.ipynb").dblclick()
    expect(current_tab(page)).to_contain_text("first.ipynb")

    client.release(held.id)
    told = toast(page, "GPU granted to second.ipynb")
    # until a clock time, "tomorrow" before it when the lease ends after midnight (a run at 23:55)
    expect(told).to_contain_text(re.compile(r"GPU granted to second\.ipynb, cell In\[\d+\] after [\d.]+ (s|min) in the queue: "
                                            r"1 GPU \(.*\), until (tomorrow )?\d\d:\d\d"))
    expect(current_tab(page)).to_contain_text("first.ipynb")  # telling does not take you away
    expect(told).to_be_in_viewport(ratio=1)  # slid in: the screenshot shows it whole
    screenshot(page, "notify-granted.png")

    told.get_by_role("button", name="Open second.ipynb").click()
    expect(current_tab(page)).to_contain_text("second.ipynb")
    active = page.locator(".jp-NotebookPanel:visible .jp-Cell.jp-mod-active")
    expect(active).to_contain_text("print('the cell got its GPU', flush=True)")  # the cell that ran, by its id
    expect(active.locator(".jp-InputPrompt")).to_have_text("[3]:")
    expect(page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output", has_text="the cell got its GPU")) \
        .to_be_visible()
    # the tab was visible: nothing went to the desktop (and the browser was not allowed to anyway)
    assert page.evaluate("window.__desktopShown") == []


@pytest.fixture
def hidden_page(lab) -> Iterator[Any]:
    """A page allowed to notify on the desktop, whose calls to the Notification API are recorded."""
    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        context.grant_permissions(["notifications"], origin=lab.url)
        context.add_init_script(RECORD_DESKTOP)
        context.add_init_script(HIDDEN_WHEN_ASKED)
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        yield page
        screenshot(page, "notify-settings-final.png")
        browser.close()


def test_a_kind_turned_off_is_not_told_and_a_hidden_tab_is_told_on_the_desktop(lab, hidden_page, client):
    page = hidden_page
    put_settings(lab, {"granted": False})
    open_panel(page, lab)
    assert page.evaluate("Notification.permission") == "granted"

    held = client.request_lease(1, heartbeat=False)
    labels = {"source": "%%gpu", "cell": "gpu In[4]", "bg": "train",
              "notebook": str(lab.root_dir / "work" / "train.ipynb")}  # the kernel's JPY_SESSION_NAME
    waiting = client.request_lease(1, heartbeat=False, labels=labels)
    assert waiting.state == "queued"
    expect(page.locator(f'#gpulease-panel [data-lease-id="{waiting.id}"]').first).to_be_visible()
    page.evaluate("window.__tabHidden = true")

    # a grant is told only after a real wait (a second or more in the queue): let this one qualify
    assert wait_until(lambda: client.info()["time"] - waiting.created_at >= 1.5)
    client.release(held.id)  # granted: turned off in the settings
    assert wait_until(lambda: client.lease(waiting.id).state == "granted"), "the queued request is granted"
    client.release(waiting.id, reason="cell finished")  # the background cell ended: told
    ended = toast(page, "Background cell train in train.ipynb finished")
    expect(ended).to_contain_text(f"lease {waiting.id} was released: cell finished")
    expect(ended.get_by_role("button", name="Open train.ipynb")).to_be_visible()
    # the events come in order: the grant came first and was not told, in the lab nor on the desktop
    expect(toast(page, "GPU granted")).to_have_count(0)
    assert wait_until(lambda: page.evaluate("window.__desktopShown.length") >= 1)
    shown = page.evaluate("window.__desktopShown")
    assert [s["title"] for s in shown] == ["Background cell train finished"]
    assert f"lease {waiting.id} was released" in shown[0]["body"]
    assert page.evaluate("window.__permissionAsked") == []  # already allowed: nothing offered, nothing asked
    expect(toast(page, "Allow desktop notifications")).to_have_count(0)
    expect(ended).to_be_in_viewport(ratio=1)
    screenshot(page, "notify-bg-finished.png")

    # the tab visible again: told in the lab only
    page.evaluate("window.__tabHidden = false")
    again = client.request_lease(1, heartbeat=False, labels={**labels, "bg": "eval"})
    client.release(again.id, reason="cell finished")
    expect(toast(page, "Background cell eval in train.ipynb finished")).to_be_visible()
    assert len(page.evaluate("window.__desktopShown")) == 1


@pytest.mark.parametrize("broker", [["--LeasePolicy.warn_before_seconds=600"]], indirect=True)
def test_an_expiry_is_warned_then_told_and_the_warning_goes(lab, page, client):
    open_panel(page, lab)
    labels = {"source": "%%gpu", "cell": "gpu In[2]", "notebook": str(lab.root_dir / "eval.ipynb")}
    lease = client.request_lease(1, heartbeat=False, duration_seconds=5, labels=labels)
    warned = toast(page, f"Lease {lease.id} will be expired in")  # the broker's words: within warn_before_seconds
    expect(warned.get_by_role("button", name="Extend…")).to_be_visible()
    ended = toast(page, f"Your GPU lease {lease.id} (eval.ipynb, cell In[2]) was expired")
    expect(ended).to_be_visible()
    # in the broker's words (its view's reason_text), not its reason code
    expect(ended).to_contain_text(client.lease(lease.id)["reason_text"])
    expect(ended).not_to_contain_text("(expired)")
    expect(ended.get_by_role("button", name="Open eval.ipynb")).to_be_visible()
    expect(warned).to_have_count(0)  # nothing left to extend: the warning went with the lease
    assert client.lease(lease.id).state == "expired"


@pytest.mark.parametrize("broker", [["--LeasePolicy.warn_before_seconds=3600"]], indirect=True)
def test_a_release_takes_its_warning_away(lab, page, client):
    open_panel(page, lab)
    lease = client.request_lease(1, heartbeat=False, duration_seconds=1800)
    warned = toast(page, f"Lease {lease.id} will be expired in")  # within warn_before_seconds: at once
    expect(warned).to_be_visible()
    client.release(lease.id)  # a release is told nothing: its warning still goes
    expect(warned).to_have_count(0)
    assert client.lease(lease.id).state == "released"


def test_the_panel_opens_at_start_when_the_setting_says_so(lab, page):
    put_settings(lab, {"openAtStart": True})
    page.goto(f"{lab.url}/lab?token={lab.token}")
    page.wait_for_selector("#jupyterlab-splash", state="detached")
    expect(page.locator("#gpulease-panel")).to_be_visible()  # nobody clicked its tab
    expect(page.locator("#gpulease-panel .jp-GpuLease-card").first).to_be_visible()


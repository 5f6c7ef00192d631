"""The JupyterLab sidebar in a real JupyterLab, in real headless Chromium, against a real broker."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from browser_support import ARTIFACTS, card, chromium_missing, open_panel, screenshot, status_item, wait_until

if why := chromium_missing():
    pytest.skip(why, allow_module_level=True)

from playwright.sync_api import expect

pytestmark = pytest.mark.browser


def test_sidebar_follows_the_broker(lab, page, client, broker):
    assert lab.get("gpulease/api/status")["broker_url"] == broker.url
    open_panel(page, lab)
    gpus = client.gpus()["gpus"]
    cards = page.locator("#gpulease-panel .jp-GpuLease-card")
    expect(cards).to_have_count(len(gpus))
    for g in gpus:
        c = card(page, g["id"])
        expect(c).to_have_attribute("data-state", "free")
        expect(c.locator(".jp-GpuLease-gpuName")).to_have_text(f"{g['index']}: {g['name']}")
        expect(c.locator(".jp-GpuLease-simulated")).to_have_text("simulated")
    expect(status_item(page)).to_have_text("GPUs 4/4 free")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "sidebar-free.png"))

    # a lease taken outside the browser (same uid) shows up as yours, from the event stream
    lease = client.request_lease(1, duration_seconds=1800)
    gpu_id = lease["devices"][0]["id"]
    expect(card(page, gpu_id)).to_have_attribute("data-state", "yours")
    expect(card(page, gpu_id).locator(".jp-GpuLease-state")).to_contain_text("left")
    expect(status_item(page)).to_have_text("GPUs 3/4 free")
    row = page.locator(f'#gpulease-panel [data-section="my-leases"] [data-lease-id="{lease["id"]}"]')
    expect(row).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "sidebar-yours.png"))

    # Release in the panel releases the broker's lease
    row.get_by_role("button", name=f"Release lease {lease['id']}").click()
    expect(card(page, gpu_id)).to_have_attribute("data-state", "free")
    assert client.lease(lease["id"])["state"] == "released"
    expect(status_item(page)).to_have_text("GPUs 4/4 free")
    expect(row).to_have_count(0)

    # the panel survives a broker restart: "broker unreachable" meanwhile, then live again
    broker.stop()
    expect(status_item(page)).to_have_text("GPUs: broker unreachable")
    expect(page.locator("#gpulease-panel .jp-GpuLease-connection")).to_have_text("broker unreachable")
    # the last state fetched is not what the GPUs do now: no card says "free"
    expect(page.locator('#gpulease-panel .jp-GpuLease-card[data-state="unknown"]')).to_have_count(len(gpus))
    expect(cards.filter(has_text="free")).to_have_count(0)
    page.screenshot(path=str(ARTIFACTS / "sidebar-unreachable.png"))
    broker.start()
    expect(status_item(page)).to_have_text("GPUs 4/4 free")
    lease2 = client.request_lease(1, duration_seconds=600)
    gpu2 = lease2["devices"][0]["id"]
    expect(card(page, gpu2)).to_have_attribute("data-state", "yours")

    # root is an admin: the admin list shows every lease, and Revoke asks for a reason
    assert client.info()["user"]["admin"] is True
    admin_row = page.locator(f'#gpulease-panel [data-section="all-leases"] [data-lease-id="{lease2["id"]}"]')
    admin_row.get_by_role("button", name=f"Revoke lease {lease2['id']}").click()
    dialog = page.locator(".jp-Dialog")
    dialog.locator("input").fill("needed for the nightly run")
    dialog.get_by_role("button", name="Revoke").click()
    expect(card(page, gpu2)).to_have_attribute("data-state", "free")
    revoked = client.lease(lease2["id"])
    assert revoked["state"] == "revoked" and "nightly" in (revoked["reason"] or "")

    # a lease of two GPUs says so in the plural
    pair = client.request_lease(2, duration_seconds=600)
    title = page.locator(f'#gpulease-panel [data-section="my-leases"] [data-lease-id="{pair["id"]}"] '
                         '.jp-GpuLease-leaseTitle')
    expect(title).to_have_text(f"{pair['id']} (GPUs {', '.join(str(d['index']) for d in pair['devices'])})")

    # the status-bar item opens the panel
    page.click('.jp-SideBar.jp-mod-left li[data-id="gpulease-panel"]')  # collapse it
    expect(page.locator("#gpulease-panel")).to_be_hidden()
    status_item(page).click()
    expect(page.locator("#gpulease-panel")).to_be_visible()


def test_gpu_cell_run_from_the_ui_shows_in_the_sidebar(lab, page, client):
    import nbformat

    magics = Path(__file__).resolve().parent.parent / "jupyter_gpulease" / "kernel" / "magics.py"
    assert magics.exists(), "jupyter_gpulease/kernel/magics.py (the %%gpu magic) is missing"
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("%load_ext jupyter_gpulease"),
                nbformat.v4.new_code_cell("%%gpu\nimport time; time.sleep(3)\nprint('done on', 'gpu')")]
    nbformat.write(nb, lab.root_dir / "gpu.ipynb")
    page.goto(f"{lab.url}/lab/tree/gpu.ipynb?token={lab.token}")
    page.wait_for_selector("#jupyterlab-splash", state="detached")
    expect(page.locator(".jp-Notebook")).to_be_visible()
    page.click('.jp-SideBar.jp-mod-left li[data-id="gpulease-panel"]')
    expect(page.locator("#gpulease-panel .jp-GpuLease-card")).to_have_count(4)
    # the kernel is connected (cells run before that would prompt for a kernel)
    expect(page.locator(".jp-StatusBar-Widget", has_text="Python 3 (ipykernel) | Idle").first).to_be_visible()
    page.locator(".jp-Notebook .jp-Cell").first.click()
    page.keyboard.press("Shift+Enter")
    expect(page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt")).to_have_text("[1]:")
    page.keyboard.press("Shift+Enter")

    yours = page.locator('#gpulease-panel .jp-GpuLease-card[data-state="yours"]')
    expect(yours).to_have_count(1)  # while the cell runs, its GPU is yours
    screenshot(page, "gpu-cell-running.png", docs="sidebar.png")  # the README's picture (make screenshots)
    expect(page.locator(".jp-OutputArea-output", has_text="done on gpu")).to_be_visible()
    expect(yours).to_have_count(0)  # and free again when it ends
    expect(page.locator('#gpulease-panel .jp-GpuLease-card[data-state="free"]')).to_have_count(4)
    assert client.gpus()["summary"]["free"] == 4
    ended = client.leases(ended=5)
    assert ended == [] or all(lease["state"] not in ("granted", "active", "idle") for lease in ended)

    # its artifacts are listed, and the link opens them in JupyterLab
    link = page.locator('#gpulease-panel [data-section="artifacts"] a.jp-GpuLease-artifact').first
    expect(link).to_be_visible()
    # when, in the sidebar's one clock format (as its notifications and dialogs say it): today, the time alone
    when = page.locator('#gpulease-panel [data-section="artifacts"] .jp-GpuLease-artifactWhen').first
    expect(when).to_have_text(re.compile(r"^\s*\d\d:\d\d( [AP]M)?$"))
    link.click()
    expect(page.locator(".lm-TabBar-tab", has_text="output.log")).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "gpu-cell-done.png"))


# warn an hour before expiry: a 30 min lease is warned about at once
@pytest.mark.parametrize("broker", [["--LeasePolicy.warn_before_seconds=3600"]], indirect=True)
def test_expiry_warning_notifies_with_an_extend_action(lab, page, client):
    open_panel(page, lab)
    lease = client.request_lease(1, duration_seconds=1800)
    toast = page.locator(".Toastify__toast", has_text=f"Lease {lease['id']} will be expired")
    expect(toast).to_be_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "expiry-warning.png"))
    before = client.lease(lease["id"])["expires_at"]
    toast.get_by_role("button", name="Extend").click()
    page.locator(".jp-Dialog").get_by_role("button", name="+1 h").click()  # the same choices as the panel's Extend
    expect(page.locator(".Toastify__toast", has_text=f"Lease {lease['id']} extended by 1 h")).to_be_visible()
    assert client.lease(lease["id"])["expires_at"] == pytest.approx(before + 3600)


def test_reserved_gpus_show_for_whom(lab, page, client):
    open_panel(page, lab)
    r = client.request("POST", "/api/v1/reservations", {"gpus": 2, "user": "alice", "duration_seconds": "2h"})
    reserved = page.locator('#gpulease-panel .jp-GpuLease-card[data-state="reserved"]')
    expect(reserved).to_have_count(2)
    expect(reserved.first.locator(".jp-GpuLease-state")).to_contain_text("reserved for alice")
    expect(status_item(page)).to_have_text("GPUs 2/4 free")
    page.screenshot(path=str(ARTIFACTS / "sidebar-reserved.png"))
    client.request("DELETE", f"/api/v1/reservations/{r['id']}")
    expect(reserved).to_have_count(0)
    expect(status_item(page)).to_have_text("GPUs 4/4 free")


def test_quickstart_opens_unmodified(lab, page):
    """The demo's copy of the quickstart (make_examples.py --copy-to) opens without the "modified" dot, also once
    its kernel has told JupyterLab its language_info (which JupyterLab writes into the notebook)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "scripts" / "make_examples.py"), "--copy-to", str(lab.root_dir)],
                   check=True)
    infos: list[bytes] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: infos.append(
        payload if isinstance(payload, bytes) else payload.encode()) if b"kernel_info_reply" in (
        payload if isinstance(payload, bytes) else payload.encode()) else None))
    page.goto(f"{lab.url}/lab/tree/quickstart.ipynb?token={lab.token}")
    page.wait_for_selector("#jupyterlab-splash", state="detached")
    expect(page.locator(".jp-StatusBar-Widget", has_text="Python 3 (ipykernel) | Idle").first).to_be_visible()
    assert wait_until(lambda: bool(infos)), "the kernel never answered kernel_info"
    page.evaluate("() => new Promise(r => setTimeout(r, 0))")  # let the page handle that answer
    tab = page.locator(".lm-TabBar-tab.jp-mod-current", has_text="quickstart.ipynb")
    expect(tab).to_be_visible()
    assert "jp-mod-dirty" not in (tab.get_attribute("class") or ""), "quickstart.ipynb opened modified"

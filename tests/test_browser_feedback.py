"""The sidebar's feedback in a real JupyterLab in real headless Chromium, against a real broker on the fake NVML
driver (so the GPUs have utilisation and memory to chart): live counters, Cancel, Release that asks when a cell
runs, Extend within policy, a notification for every action, live charts fed by the event stream."""

from __future__ import annotations

import re

import nbformat
import pytest
from browser_support import card, chromium_missing, lease_row, open_panel, screenshot, toast, wait_until
from fake_nvml import FakeNvml

if why := chromium_missing():
    pytest.skip(why, allow_module_level=True)

from playwright.sync_api import expect

pytestmark = pytest.mark.browser


@pytest.fixture
def broker(broker_factory, tmp_path, request):
    """Two GPUs of the fake NVML driver, sampled every half second; ``broker.nvml`` changes what they report."""
    state = FakeNvml.standard(tmp_path / "nvml.state", 2)
    b = broker_factory(gpus=2, env=state.env(), args=[
        "--tick=0.1", "--inventory=nvml", "--LeaseBroker.sample_seconds=0.5", *getattr(request, "param", [])])
    b.nvml = state
    return b


def requests_to(page, path: str) -> list[str]:
    """Every request the page makes to the server extension's ``path`` from now on (a live list)."""
    seen: list[str] = []
    page.on("request", lambda r: seen.append(r.url) if f"/gpulease/api/{path}" in r.url else None)
    return seen


def test_gpu_cards_chart_the_last_minutes_from_the_event_stream(lab, page, broker):
    gpus_fetched = requests_to(page, "gpus")
    open_panel(page, lab)
    nvml = broker.nvml
    gpu0 = card(page, nvml.gpus[0].uuid)
    chart = gpu0.locator("svg.jp-GpuLease-chart")
    nvml.gpus[0].util, nvml.gpus[0].memory_used = (80, 30), 40 << 30  # of 80 GiB
    nvml.write()
    expect(chart).to_have_attribute("aria-label", re.compile(r"utilisation 80 %, memory 50 %"))
    expect(gpu0.locator(".jp-GpuLease-util")).to_have_text(" · 80%")
    expect(gpu0.locator(".jp-GpuLease-memUsed")).to_have_text("40 GiB / 80 GiB")
    before, fetches = int(chart.get_attribute("data-samples") or 0), len(gpus_fetched)
    nvml.gpus[0].util = (10, 5)
    nvml.write()
    expect(chart).to_have_attribute("aria-label", re.compile(r"utilisation 10 %"))
    assert wait_until(lambda: int(chart.get_attribute("data-samples") or 0) >= before + 3), "no new samples charted"
    # both curves span the samples: a point per sample, and the latest carried to the right edge
    points = chart.locator("polyline.jp-GpuLease-chartUtil").get_attribute("points") or ""
    assert len(points.split()) >= before + 4
    assert len(gpus_fetched) == fetches, "the chart polled the GPU list instead of following the events"
    screenshot(page, "sidebar-gpu-charts.png")


def test_waited_counts_live_and_cancel_withdraws_the_request(lab, page, client, broker):
    open_panel(page, lab)
    held = [client.request_lease(1, heartbeat=False) for _ in range(2)]
    queued = client.request_lease(1, heartbeat=False)
    assert queued["state"] == "queued" and all(x["state"] == "granted" for x in held)
    item = page.locator(f'#gpulease-panel .jp-GpuLease-queueItem[data-lease-id="{queued["id"]}"]')
    waited = item.locator(".jp-GpuLease-waited")
    expect(waited).to_be_visible()
    # when it will likely start and why it waits: the broker's words, as the cell and the CLI show them
    def shows_the_brokers_words() -> bool:
        entry = client.queue()[0]
        assert entry["estimate_text"] and entry["wait"]["text"], entry
        said = item.inner_text()
        return f"start: {entry['estimate_text']}" in said and entry["wait"]["text"] in said
    assert wait_until(shows_the_brokers_words), item.inner_text()
    expect(item.locator(".jp-GpuLease-eta")).to_have_count(0)  # no estimate of its own beside the broker's
    expect(lease_row(page, queued["id"])).to_contain_text(client.lease(queued["id"])["wait"]["text"])
    queue_fetched = requests_to(page, "queue")
    for _ in range(3):  # a refetch may still follow the requests' events: look for a tick between fetches
        queue_fetched.clear()
        first = waited.inner_text()
        expect(waited).not_to_have_text(first)
        if not queue_fetched:
            break
    assert queue_fetched == [], "the waited counter moved only when the queue was fetched again"

    row = lease_row(page, queued["id"])
    expect(row.get_by_role("button", name=f"Release lease {queued['id']}")).to_have_count(0)  # nothing to release yet
    row.get_by_role("button", name=f"Cancel request {queued['id']}").click()
    expect(toast(page, f"Cancelled request {queued['id']} after")).to_contain_text("(was position 1)")
    assert client.lease(queued["id"])["state"] == "cancelled"
    expect(row).to_have_count(0)

    # a failure says why: the broker is gone when Release is clicked
    row = lease_row(page, held[0]["id"])
    expect(row).to_be_visible()
    broker.stop()
    row.get_by_role("button", name=f"Release lease {held[0]['id']}").click()
    expect(toast(page, f"Could not release lease {held[0]['id']}")).to_contain_text("broker")
    screenshot(page, "sidebar-release-failed.png")


# a lease may run 45 min from its grant: a 30 min lease has room for +15 min, not for +1 h
@pytest.mark.parametrize("broker", [["--LeasePolicy.max_duration_seconds=2700"]], indirect=True)
def test_release_asks_while_a_cell_runs_and_extend_offers_what_the_policy_allows(lab, page, client):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("%load_ext jupyter_gpulease"),
                nbformat.v4.new_code_cell("%%gpu --time 30m\nimport time\nprint('started', flush=True)\n"
                                          "time.sleep(600)")]
    nbformat.write(nb, lab.root_dir / "long.ipynb")
    page.goto(f"{lab.url}/lab/tree/long.ipynb?token={lab.token}")
    page.wait_for_selector("#jupyterlab-splash", state="detached")
    page.click('.jp-SideBar.jp-mod-left li[data-id="gpulease-panel"]')
    expect(page.locator(".jp-StatusBar-Widget", has_text="Python 3 (ipykernel) | Idle").first).to_be_visible()
    page.locator(".jp-Notebook .jp-Cell").first.click()
    page.keyboard.press("Shift+Enter")
    expect(page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt")).to_have_text("[1]:")
    page.keyboard.press("Shift+Enter")
    expect(page.locator(".jp-OutputArea-output", has_text="started")).to_be_visible()
    assert wait_until(lambda: any(x["pids"] for x in client.leases())), "the cell's worker attaches to its lease"
    lease = client.leases()[0]
    row = lease_row(page, lease["id"])
    # a running cell keeps its lease busy: no idle countdown, on its row or its GPU's card
    gpu = card(page, lease["devices"][0]["id"])
    expect(gpu).to_have_attribute("data-state", "yours")
    expect(row.locator(".jp-GpuLease-leaseState")).to_contain_text(" left")
    expect(row.locator(".jp-GpuLease-leaseState")).not_to_contain_text("idle in")
    expect(gpu.locator(".jp-GpuLease-state")).not_to_contain_text("idle in")
    # the card and the row count the same time left at the same moment
    where = [f'#gpulease-panel [data-section="my-leases"] [data-lease-id="{lease["id"]}"] .jp-GpuLease-leaseState',
             f'#gpulease-panel .jp-GpuLease-card[data-gpu-id="{lease["devices"][0]["id"]}"] .jp-GpuLease-state']
    texts = page.evaluate("""where => where.map(s => /(\\S+(?: \\S+)?) left/.exec(
        document.querySelector(s).textContent)[1])""", where)
    assert texts[0] == texts[1], texts

    # Extend offers the choices that fit the policy; a custom time past it is explained, not sent
    extend = row.get_by_role("button", name=f"Extend lease {lease['id']}")
    extend.click()
    dialog = page.locator(".jp-Dialog")
    expect(dialog).to_contain_text("The policy allows up to")
    expect(dialog.get_by_role("button", name="+1 h")).to_have_count(0)
    expect(dialog.get_by_role("button", name="(the limit)")).to_have_count(0)  # +15 min is the limit itself
    screenshot(page, "sidebar-extend-choices.png")
    before = client.lease(lease["id"])["expires_at"]
    dialog.get_by_role("button", name="Custom…").click()
    page.locator(".jp-Dialog input").fill("2h")
    page.locator(".jp-Dialog").get_by_role("button", name="Extend").click()
    expect(toast(page, f"Lease {lease['id']} not extended: 2 h is more than the policy allows")).to_be_visible()
    assert client.lease(lease["id"])["expires_at"] == before

    # a choice extends the lease and says until when
    extend.click()
    dialog.get_by_role("button", name="+15 min").click()
    expect(toast(page, f"Lease {lease['id']} extended by 15 min: it now ends at")).to_be_visible()
    assert client.lease(lease["id"])["expires_at"] == pytest.approx(before + 900)
    # at the limit, Extend explains why not
    expect(row.locator(".jp-GpuLease-leaseState")).to_contain_text(re.compile(r"4[45] min left"))
    extend.click()
    expect(toast(page, f"Lease {lease['id']} cannot be extended")).to_contain_text("the longest the policy allows")

    # Release asks first while the cell runs; "Keep running" keeps it
    row.get_by_role("button", name=f"Release lease {lease['id']}").click()
    expect(dialog).to_contain_text("A cell is running on it")
    screenshot(page, "sidebar-release-confirm.png")
    dialog.get_by_role("button", name="Keep running").click()
    expect(dialog).to_have_count(0)
    assert client.lease(lease["id"])["state"] in ("granted", "active", "idle")
    row.get_by_role("button", name=f"Release lease {lease['id']}").click()
    dialog.get_by_role("button", name="Release").click()
    expect(toast(page, f"Released lease {lease['id']}: GPU")).to_be_visible()
    expect(page.locator(".jp-OutputArea-output", has_text="was released by")).to_be_visible()
    assert client.lease(lease["id"])["state"] == "released"

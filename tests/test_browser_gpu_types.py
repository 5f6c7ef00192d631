"""The sidebar on a mixed broker, in a real JupyterLab and a real headless Chromium: each GPU card says its
memory (and a MIG slice says so), and the queue says what a request waits for (a GPU type, a memory size)."""

from __future__ import annotations

import pytest
from browser_support import card, open_panel, screenshot
from playwright.sync_api import expect

pytestmark = pytest.mark.browser


@pytest.fixture
def broker(broker_factory):
    return broker_factory(args=["--tick=0.1", "--SimulatedInventory.cluster=1x2:A100-40GB,1x1:H100:80G"])


def test_cards_show_type_and_memory_and_the_queue_what_it_waits_for(lab, page, client):
    open_panel(page, lab)
    gpus = client.gpus()["gpus"]
    assert [(g["name"], g["memory_total"] >> 30) for g in gpus] == [("A100-40GB", 40)] * 2 + [("H100", 80)]
    for g in gpus:
        c = card(page, g["id"])
        expect(c.locator(".jp-GpuLease-gpuName")).to_have_text(f"{g['index']}: {g['name']}")
        expect(c.locator(".jp-GpuLease-kind")).to_have_text(f"{g['memory_total'] >> 30} GiB")
        expect(c.locator(".jp-GpuLease-kind")).to_have_attribute("data-mig", "false")
    held = client.request_lease(1, gpu_type="H100", duration_seconds=1800)
    assert held["devices"][0]["name"] == "H100"
    waiting = client.request_lease(1, gpu_mem="64G", gpu_type="H100", duration_seconds=600)
    assert waiting["state"] == "queued"
    item = page.locator(f'#gpulease-panel .jp-GpuLease-queueItem[data-lease-id="{waiting["id"]}"]')
    expect(item).to_contain_text("1 GPU, H100, ≥ 64 GiB each, waited")
    screenshot(page, "sidebar-gpu-types.png")
    client.release(held["id"])
    expect(item).to_have_count(0)  # granted on the H100 once it is free
    assert client.lease(waiting["id"])["devices"][0]["name"] == "H100"

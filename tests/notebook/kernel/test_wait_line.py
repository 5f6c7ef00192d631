"""What a queued cell says while it waits (the text line outside a notebook, the widget's text inside one) and
how the CLI and the kernel show a start estimate: the broker's words (``estimate_text``), made once by the broker."""

from __future__ import annotations

import time

import pytest

from jupyter_gpulease.client import LeaseView
from jupyter_gpulease.kernel.acquire import WaitDisplay
from jupyter_gpulease.tables import lease_text, queue_table

NOW = 10_000.0


def test_the_waiting_line_shows_the_brokers_words_for_why_and_when(capsys):
    """The broker's ``wait.text`` and ``estimate_text`` as they are: the kernel formats no estimate of its own."""
    now = time.time()
    lease = LeaseView.from_json({
        "id": "l-1", "state": "queued", "phase": "queued", "position": 2, "estimated_start": now + 150,
        "estimated_start_range": [now + 70, now + 240], "estimate_text": "in 1–3 min",
        "wait": {"reason": "gpus_busy", "text": "all 4 GPUs are busy: bob's 2 end in about 2 min"}})
    WaitDisplay("%%gpu 1").update(lease, 41.0)
    line = capsys.readouterr().err.strip()
    assert line.startswith("⏳ %%gpu 1: queued, position 2, waited 41 s"), line
    assert "estimated start in 1–3 min" in line and "bob's 2 end in about 2 min" in line, line
    assert "~1–4 min" not in line  # not the kernel's own formatting of the range


def test_a_lease_that_ended_is_said_in_the_brokers_words():
    from jupyter_gpulease.kernel.acquire import ended_text

    view = LeaseView.from_json({"id": "l-1", "state": "revoked", "phase": "ended", "reason": "idle_pressure",
                                "reason_text": "revoked: idle for 10 min while others waited"})
    assert ended_text(view) == "revoked: idle for 10 min while others waited"
    assert ended_text(LeaseView(id="l-2", state="cancelled", phase="ended", reason="cancelled")) == "cancelled"  # an older broker


def test_the_waiting_line_without_an_estimate_says_nothing_of_one(capsys):
    WaitDisplay("%%gpu 1").update(LeaseView(id="l-1", state="queued", phase="queued", position=1), 3.0)
    assert capsys.readouterr().err.strip() == "⏳ %%gpu 1: queued, position 1, waited 3 s"


def test_the_queue_table_shows_the_brokers_estimate_and_why():
    now = time.time()
    row = {"position": 1, "user": "bob", "lease_id": "l-1", "min_gpus": 1, "max_gpus": 1, "fraction": 1.0,
           "priority": "normal", "waited_seconds": 30.0, "estimated_start": now + 150,
           "estimated_start_range": [now + 70, now + 240], "estimate_text": "in 1–3 min",
           "wait": {"reason": "gpus_busy", "text": "all 4 GPUs are busy"}}
    line = queue_table([row]).splitlines()[1]
    assert "in 1–3 min" in line and line.endswith("all 4 GPUs are busy") and "~1–4" not in line


def test_show_says_when_a_queued_lease_will_likely_start():
    lease = LeaseView.from_json({"id": "l-1", "state": "queued", "phase": "queued", "user": "bob",
                                 "created_at": NOW - 30, "position": 1, "estimated_start": NOW + 600,
                                 "estimated_start_range": [NOW + 300, NOW + 1500], "estimate_text": "in 5–25 min"})
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lease_text(lease, [], now=NOW).splitlines()[:9]
            if line.strip()}
    assert rows["starts"] == "in 5–25 min"


def test_a_request_that_queues_behind_this_kernels_last_lease_shows_no_wait_line_at_first(broker_factory, capsys):
    """The next cell's request may queue for the GPU its own last cell gives back as that cell's worker exits (Run All
    on a full cluster): while this kernel is still giving that lease back, no wait line is shown."""
    import threading

    from waiting import wait_for

    from jupyter_gpulease.kernel.acquire import HOLDINGS, acquire

    broker = broker_factory(gpus=1, args=["--tick=0.1"])
    c = broker.client()
    last = c.request_lease(1, heartbeat=False)
    HOLDINGS.add(c, last["id"], "cell")
    HOLDINGS.giving_back(last["id"])  # as LeaseRun._reap notes before the last cell's worker is gone

    def reaper() -> None:  # as LeaseRun._reap does once the last cell's worker is gone
        wait_for(lambda: c.queue(), 10, "the next request queued")
        c.release(last["id"])
        HOLDINGS.discard(last["id"])

    thread = threading.Thread(target=reaper, daemon=True)
    thread.start()
    got = acquire(c, {"gpus": 1, "heartbeat": False}, 10.0, "%%gpu 1")
    HOLDINGS.discard(got.id)
    assert got.state == "granted" and got.devices == last["devices"]
    assert "queued" not in capsys.readouterr().err  # no wait line was shown
    thread.join(5)


def test_back_to_back_cells_on_one_gpu_each_get_it(broker_factory, tmp_path) -> None:
    """Run All on a one-GPU broker through a real kernel: each cell's request comes while the last cell's lease is
    still being given back; each cell runs, none shows the wait widget."""
    from kernels import Kernel

    broker = broker_factory(gpus=1, args=["--tick=0.1"])
    k = Kernel(broker.url, str(tmp_path / "art"))
    try:
        for i in range(5):
            r = k.run(f"%%gpu 1\nprint('cell', {i})")
            assert r.status == "ok" and f"cell {i}" in r.stdout, r.outputs
            assert not [o for o in r.outputs if o["msg_type"] == "display_data"], r.outputs  # no wait widget
    finally:
        k.stop()


def test_a_request_waiting_for_another_holders_gpu_shows_the_wait_line_after_the_quiet_spell(broker_factory, capsys,
                                                                                            monkeypatch):
    """This kernel giving a lease back keeps the wait line away only ``QUIET_FOR``: a GPU that another holder keeps
    still shows where the request stands."""
    from jupyter_gpulease.kernel import acquire as acquiring

    broker = broker_factory(gpus=1, args=["--tick=0.1"])
    c = broker.client()
    c.request_lease(1, heartbeat=False)  # the other holder (a --bg cell, another notebook): keeps the one GPU
    mine = c.request_lease(1, heartbeat=False)  # queued behind it: never released here, only noted as given back
    acquiring.HOLDINGS.add(c, mine["id"], "cell")
    acquiring.HOLDINGS.giving_back(mine["id"])
    monkeypatch.setattr(acquiring, "QUIET_FOR", 0.3)
    try:
        with pytest.raises(acquiring.LeaseUnavailable):
            acquiring.acquire(c, {"gpus": 1, "heartbeat": False}, 1.5, "%%gpu 1")
    finally:
        acquiring.HOLDINGS.discard(mine["id"])
    assert "queued, position" in capsys.readouterr().err

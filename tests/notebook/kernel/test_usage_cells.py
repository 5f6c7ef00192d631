"""What a cell's lease used, end to end with a real broker (simulated inventory: the lease's processes' resident
memory and CPU stand in for GPU memory and utilisation), a real kernel and real CLI processes: the `--mem` hint
after a cell on a shared GPU, meta.json, `gpulease show`, and the chargeback CSV by notebook and by label."""

from __future__ import annotations

import csv
import getpass
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from kernels import Kernel
from waiting import wait_for

GIB = 1 << 30
ME = getpass.getuser()
# a cell that holds ~300 MiB and burns CPU for a while: several samples (every 0.1 s) see it
CELL = ("%%gpu {gpus}\nimport time\nx = bytearray(300 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\n"
        "t = time.time()\nwhile time.time() - t < 1.5: pass\nprint('done')")


def gpulease(url: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEASE_")}
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", *args], capture_output=True, text=True,
                       env={**env, "GPULEASE_BROKER": url}, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_cell_on_a_shared_gpu_that_used_little_gets_a_hint_and_its_figures_are_kept(broker_factory,
                                                                                       tmp_path: Path) -> None:
    broker = broker_factory(gpus=2, args=["--tick=0.1", "--LeaseBroker.sample_seconds=0.1",
                                          f"--LeaseBroker.admin_users=['{ME}']"])
    k = Kernel(broker.url, str(tmp_path / "art"), {"JPY_SESSION_NAME": "/home/me/train.ipynb"})
    try:
        r = k.run(CELL.format(gpus="0.5"))
        assert r.status == "ok" and "done" in r.stdout, r.outputs
        lease_id = r.stdout.split("gpulease: lease ")[1].split()[0]
        hint = next(line for line in r.stdout.splitlines() if "of GPU memory it held" in line)
        assert "40.0 GiB" in hint and "shared GPU" in hint and "--mem 1G" in hint, hint

        meta_path = tmp_path / "art" / lease_id / "meta.json"
        wait_for(meta_path.exists, 10, "meta.json")
        usage = json.loads(meta_path.read_text())["usage"]
        assert usage["held_memory"] == 40 * GIB and usage["source"] == "process"
        assert 300 << 20 < usage["peak_memory"] < GIB and usage["samples"] >= 2
        assert usage["mean_utilization"] > 0 and usage["peak_utilization"] >= usage["mean_utilization"]

        shown = gpulease(broker.url, "show", lease_id)
        assert "gpu memory    peak " in shown and " of 40.0 GiB held" in shown, shown
        assert f"mean {usage['mean_utilization']:.0f}%, peak {usage['peak_utilization']:.0f}%" in shown, shown

        r = k.run(CELL.format(gpus="1"))  # a whole GPU: no hint, however little it used
        assert r.status == "ok" and "of GPU memory it held" not in r.stdout, r.outputs
    finally:
        k.stop()

    c = broker.client()
    c.release(c.request_lease(1, heartbeat=False, labels={"project": "vision"})["id"])
    by_notebook = list(csv.reader(io.StringIO(gpulease(broker.url, "admin", "usage", "--since", "30d", "--by",
                                                       "notebook", "--csv"))))
    assert by_notebook[0] == ["notebook", "gpu_hours_held", "gpu_hours_busy", "leases", "revocations", "preempted",
                              "peak_memory_bytes", "mean_utilization_percent"]
    rows = {r[0]: r for r in by_notebook[1:]}
    assert set(rows) == {"/home/me/train.ipynb", ""}
    assert rows["/home/me/train.ipynb"][3] == "2" and int(rows["/home/me/train.ipynb"][6]) >= usage["peak_memory"]
    # the CLI lease ran nothing: nothing measured, or 0 bytes if a sample fell within its short life
    assert rows[""][3] == "1" and rows[""][6] in ("", "0")
    by_label = gpulease(broker.url, "admin", "usage", "--since", "30d", "--by", "label", "--label", "project",
                        "--csv").splitlines()
    assert by_label[0].startswith("project,") and by_label[1].startswith(",") and by_label[2].startswith("vision,")
    table = gpulease(broker.url, "admin", "usage", "--by", "user")
    assert "PEAK MEM" in table and "MEAN UTIL" in table and ME in table


def test_a_notebooks_next_gpu_cell_gets_the_gpu_its_last_cell_gave_back(broker_factory, tmp_path: Path) -> None:
    """Warm re-grants through a real kernel: %%gpu labels its requests with the notebook (JPY_SESSION_NAME, as
    Jupyter server sets it). A cell runs on the second GPU while another lease holds the first; that lease ends;
    the notebook's next cell gets the second GPU again, where best fit alone would give it the first."""
    broker = broker_factory(gpus=2, args=["--tick=0.1"])
    c = broker.client()
    k = Kernel(broker.url, str(tmp_path / "art"), {"JPY_SESSION_NAME": "/home/me/train.ipynb"})
    cell = "%%gpu 1\nimport os\nprint('devices', os.environ['CUDA_VISIBLE_DEVICES'])"
    try:
        other = c.request_lease(1, heartbeat=False)
        first = k.run(cell)
        assert first.status == "ok", first.outputs
        c.release(other["id"])
        first_id = first.stdout.split("gpulease: lease ")[1].split()[0]
        wait_for(lambda: c.lease(first_id)["state"] == "released", 10, "the first cell's lease released")
        again = k.run(cell)  # the notebook's next cell, after its last one ended (released just after its answer)
        assert again.status == "ok", again.outputs
        devices = [r.stdout.split("devices ")[1].split()[0] for r in (first, again)]
        assert devices[0] == devices[1]
        leases = [c.lease(r.stdout.split("gpulease: lease ")[1].split()[0]) for r in (first, again)]
        assert leases[0]["devices"] == leases[1]["devices"] != other["devices"]
        assert leases[1]["labels"]["notebook"] == "/home/me/train.ipynb"
    finally:
        k.stop()

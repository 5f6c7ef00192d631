"""Stopping a real JupyterLab with a running ``%%gpu`` cell while a browser's sidebar polls: no server traceback."""

from __future__ import annotations

import http.client
import re
import signal
import threading
import time
from pathlib import Path

from jupyter_client import BlockingKernelClient
from lab_server import LabServer
from waiting import wait_for

SIDEBAR = ("gpulease/api/info", "gpulease/api/gpus", "gpulease/api/queue", "gpulease/api/leases",
           "gpulease/api/artifacts")


class KeepAlivePoller(threading.Thread):
    """What the sidebar does: one kept-alive connection, polled until the server closes it. The server stops
    accepting connections at once on a stop signal but answers open ones until its kernels have stopped."""

    def __init__(self, lab: LabServer, path: str) -> None:
        super().__init__(daemon=True)
        self.lab, self.path = lab, path
        self.answers: list[tuple[float, int]] = []  # (monotonic time, HTTP status)

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.lab.port, timeout=10)
        while True:
            try:
                conn.request("GET", "/" + self.path, headers={"Authorization": f"token {self.lab.token}"})
                response = conn.getresponse()
                response.read()
            except (OSError, http.client.HTTPException):
                return
            self.answers.append((time.monotonic(), response.status))


def test_stopping_jupyterlab_with_a_running_cell_prints_no_server_traceback(broker, tmp_path: Path) -> None:
    lab = LabServer(tmp_path / "lab", env={"GPULEASE_BROKER": broker.url}).start()
    pollers: list[KeepAlivePoller] = []
    kc: BlockingKernelClient | None = None
    try:
        kernel = lab.post("api/kernels", {"name": "python3"})
        kc = BlockingKernelClient(connection_file=str(lab.workdir / "runtime" / f"kernel-{kernel['id']}.json"))
        kc.load_connection_file()
        kc.start_channels()
        kc.wait_for_ready(60)
        kc.execute("%load_ext jupyter_gpulease")
        kc.execute("%%gpu 1\nimport time\ntime.sleep(120)\n")
        wait_for(lambda: [x for x in lab.get("gpulease/api/leases")["leases"] if x["state"] == "granted"],
                 timeout=60, what="the running cell's lease")
        pollers = [KeepAlivePoller(lab, path) for path in SIDEBAR]
        for p in pollers:
            p.start()
        wait_for(lambda: all(p.answers for p in pollers), timeout=30, what="every sidebar poll answered once")
        signalled = time.monotonic()
        # SIGTERM takes the same way out as the demo's Ctrl-C (--ServerApp.answer_yes): ServerApp.stop(from_signal)
        lab.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert lab.proc.wait(60) == 0  # type: ignore[union-attr]
        for p in pollers:
            p.join(15)
    finally:
        if kc is not None:
            kc.stop_channels()
        lab.stop()
    log = lab.log_path.read_text(errors="replace")
    after = [status for p in pollers for at, status in p.answers if at > signalled]
    assert after, "no sidebar poll was answered while the server stopped (the case under test did not occur)"
    assert set(after) == {200}, after
    assert "cannot schedule new futures" not in log
    assert "Uncaught exception" not in log
    # the server's own tracebacks; ipykernel 7.4 itself logs one ("[IPKernelApp] ERROR | Exception in message
    # handler", a ZMQError) when it is shut down during a cell, with or without this extension
    server_tracebacks = [m.group(0) for m in re.finditer(r"^(?!\[IPKernelApp\]).*\n(\s*)Traceback", log, re.M)]
    assert not server_tracebacks, log[-6000:]

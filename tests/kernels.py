"""Real IPython kernels through jupyter_client, with the extension loaded and a broker configured."""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import KernelManager


@dataclass
class Reply:
    status: str
    outputs: list[dict[str, Any]] = field(default_factory=list)
    reply: dict[str, Any] = field(default_factory=dict)

    @property
    def stdout(self) -> str:
        return "".join(o["content"]["text"] for o in self.outputs
                       if o["msg_type"] == "stream" and o["content"]["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(o["content"]["text"] for o in self.outputs
                       if o["msg_type"] == "stream" and o["content"]["name"] == "stderr")

    @property
    def error(self) -> dict[str, Any] | None:
        """The error output, or for a UsageError (printed, not raised as output) the reply's ename/evalue."""
        for o in self.outputs:
            if o["msg_type"] == "error":
                return dict(o["content"])
        if self.reply.get("status") == "error":
            return {"ename": self.reply.get("ename"), "evalue": self.reply.get("evalue"),
                    "traceback": self.reply.get("traceback", [])}
        return None

    @property
    def result(self) -> str | None:
        for o in self.outputs:
            if o["msg_type"] == "execute_result":
                return str(o["content"]["data"].get("text/plain"))
        return None


class Kernel:
    """A started kernel: ``run(code)`` executes and collects every output of that cell."""

    def __init__(self, broker_url: str, artifact_root: str, extra_env: dict[str, str] | None = None,
                 log: str | None = None) -> None:
        """``log``: a file the kernel's own stderr (its log) goes to; None: this process's stderr."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEASE_")}
        env.update({"GPULEASE_BROKER": broker_url, "GPULEASE_ARTIFACT_ROOT": artifact_root, **(extra_env or {})})
        self.km = KernelManager(kernel_name="python3")
        self.log = log
        if log is not None:
            with open(log, "ab") as f:  # the kernel keeps its own descriptor
                self.km.start_kernel(env=env, stderr=f)
        else:
            self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.stray: list[dict[str, Any]] = []  # iopub messages of other cells (e.g. --bg output)
        r = self.run("%load_ext jupyter_gpulease")
        assert r.status == "ok", r.outputs

    def log_lines(self, text: str) -> list[str]:
        """The lines of the kernel's log (``log``) with ``text``."""
        assert self.log is not None, "the kernel was started without log="
        with open(self.log, errors="replace") as f:
            return [line.rstrip("\n") for line in f if text in line]

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.pid)  # type: ignore[union-attr]

    def kill9(self) -> None:
        """SIGKILL the kernel: no cleanup code in it runs."""
        os.kill(self.pid, 9)

    def submit(self, code: str) -> str:
        return str(self.kc.execute(code, allow_stdin=False))

    def wait_queued(self, msg_id: str, timeout: float = 30.0) -> Reply:
        """The outputs of ``msg_id`` up to its wait display (the text line, or the widget with a comm): the cell is
        queued and in its wait loop (an interrupt now lands there, not in the request)."""
        return self.collect(msg_id, timeout, until=lambda outs: any(
            o["msg_type"] == "display_data" or "queued, position" in o["content"].get("text", "") for o in outs))

    def collect(self, msg_id: str, timeout: float = 60.0, until: Any = None) -> Reply:
        """Collect iopub output of ``msg_id`` until it is idle (or ``until(outputs)`` is true)."""
        deadline = time.monotonic() + timeout
        outputs: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                self.stray.append(msg)
                continue
            t = msg["msg_type"]
            if t == "status" and msg["content"]["execution_state"] == "idle":
                reply = self._reply(msg_id)
                return Reply(reply["content"]["status"], outputs, reply["content"])
            if t in ("stream", "error", "execute_result", "display_data", "update_display_data"):
                outputs.append(msg)
                if until is not None and until(outputs):
                    return Reply("partial", outputs)
        raise TimeoutError(f"cell {msg_id} did not finish within {timeout} s; outputs so far: {outputs}")

    def _reply(self, msg_id: str) -> dict[str, Any]:
        """The shell reply to ``msg_id``: earlier replies (e.g. the extra kernel_info replies that
        ``wait_for_ready`` may leave behind) are skipped, not taken for this cell's."""
        deadline = time.monotonic() + 10
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return dict(reply)

    def run(self, code: str, timeout: float = 60.0) -> Reply:
        return self.collect(self.submit(code), timeout)

    def stop(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)

"""The relay of the Slurm executor, on the GPU node: ``python -m jupyter_gpulease.executors.slurm_relay``
run by ``srun`` as a step of the lease's allocation.

It starts the worker (``python -m jupyter_gpulease.worker``) in its own process group, with the
``CUDA_VISIBLE_DEVICES`` Slurm gave the step, and multiplexes the worker's three channels (stdout,
stderr, framed results) onto its own stdout as lines ``<tag> <base64>\\n``; it takes the kernel's jobs,
interrupts and kill requests on its stdin the same way. The kernel side is ``slurm.SlurmWorker``.
It imports nothing of the kernel side (no traitlets, no IPython): it starts fast on the GPU node.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading

from ..worker.env import worker_env

# relay -> kernel
INFO, STDOUT, STDERR, CTRL, EXIT = 0, 1, 2, 3, 4
# kernel -> relay
JOB, SIGNAL, KILL = 1, 2, 3


def encode_line(tag: int, data: bytes) -> bytes:
    return b"%d %s\n" % (tag, base64.b64encode(data))


def decode_line(line: bytes) -> tuple[int, bytes] | None:
    tag, _, data = line.strip().partition(b" ")
    try:
        return int(tag), base64.b64decode(data)
    except ValueError:
        return None


# ------------------------------------------------------------------------------ relay (on the GPU node)
class Relay:
    def __init__(self, args: list[str]) -> None:
        self.out = os.dup(1)
        os.dup2(2, 1)  # a stray print of this process must not corrupt the channel
        self._wlock = threading.Lock()
        r, w = os.pipe()
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        where = {"GPULEASE_NODE": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
                 "GPULEASE_SLURM_JOB_ID": os.environ.get("SLURM_JOB_ID", ""),
                 "GPULEASE_SLURM_STEP_ID": os.environ.get("SLURM_STEP_ID", "")}
        env = worker_env({**where, "GPULEASE_CTRL_FD": str(w), "CUDA_VISIBLE_DEVICES": self.visible})
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyter_gpulease.worker", *args], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(w,), env=env, start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(w)
        self.emit(INFO, json.dumps({
            "pid": self.proc.pid, "relay_pid": os.getpid(), "hostname": socket.gethostname(),
            "node": where["GPULEASE_NODE"], "job_id": where["GPULEASE_SLURM_JOB_ID"],
            "step_id": where["GPULEASE_SLURM_STEP_ID"], "cuda_visible_devices": self.visible,
        }).encode())
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.pumps = [threading.Thread(target=self._pump, args=(fd, tag), daemon=True)
                      for fd, tag in ((self.proc.stdout.fileno(), STDOUT), (self.proc.stderr.fileno(), STDERR),
                                      (r, CTRL))]
        for t in self.pumps:
            t.start()
        threading.Thread(target=self._input, daemon=True).start()
        for sig in (signal.SIGTERM, signal.SIGHUP):  # Slurm ending the step, srun gone: take the worker along
            signal.signal(sig, lambda s, _f: threading.Thread(target=self.kill, args=(2.0,), daemon=True).start())
        signal.signal(signal.SIGINT, lambda s, _f: self.signal(signal.SIGINT))

    def emit(self, tag: int, data: bytes) -> None:
        line = encode_line(tag, data)
        with self._wlock:
            view = memoryview(line)
            while view:
                n = os.write(self.out, view)
                view = view[n:]

    def _pump(self, fd: int, tag: int) -> None:
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            with contextlib.suppress(OSError):
                self.emit(tag, data)
            if not data:
                if tag == CTRL:
                    os.close(fd)
                return

    def _input(self) -> None:
        stdin = sys.stdin.buffer
        while True:
            line = stdin.readline()
            if not line:
                break
            msg = decode_line(line)
            if msg is None:
                continue
            tag, data = msg
            if tag == JOB:
                with contextlib.suppress(OSError, ValueError):
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(data)
                    self.proc.stdin.flush()
            elif tag == SIGNAL:
                self.signal(int(json.loads(data)["signal"]))
            elif tag == KILL:
                grace = float(json.loads(data)["grace"])
                threading.Thread(target=self.kill, args=(grace,), daemon=True).start()
        with contextlib.suppress(OSError, ValueError):  # the kernel is gone: the worker's lifeline closes
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def signal(self, sig: int) -> None:
        if sig == signal.SIGINT:  # like a local run: to the worker only (it raises KeyboardInterrupt)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill(self, grace: float) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            self.signal(sig)
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.signal(signal.SIGKILL)  # what is left of the group (the cell's own children)

    def run(self) -> int:
        rc = self.proc.wait()
        for t in self.pumps:
            t.join(10)
        self.emit(EXIT, json.dumps({"returncode": rc}).encode())
        return 0


def main(argv: list[str] | None = None) -> None:
    relay = Relay(list(sys.argv[1:] if argv is None else argv))
    sys.exit(relay.run())


if __name__ == "__main__":
    main()

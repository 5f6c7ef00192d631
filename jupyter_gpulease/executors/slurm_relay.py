"""The relay of the Slurm executor, on the GPU node: ``python -m jupyter_gpulease.executors.slurm_relay``
run by ``srun`` as a step of the lease's allocation.

It starts the worker (``python -m jupyter_gpulease.worker``) in its own process group, with the
``CUDA_VISIBLE_DEVICES`` Slurm gave the step, and multiplexes the worker's three channels (stdout,
stderr, framed results) onto its own stdout as lines ``<tag> <base64>\\n``; it takes the kernel's jobs,
interrupts and kill requests on its stdin the same way. The kernel side is ``slurm.SlurmWorker``.
On a node without the shared artifact root the kernel opens a direct channel (``slurm_bulk``; OPEN/OPENED): large
jobs and results then travel there, each frame announced by a BULK line here so that the order holds.
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
from collections.abc import Iterator

from ..worker.env import sees_marker, worker_env
from . import slurm_bulk

# relay -> kernel
INFO, STDOUT, STDERR, CTRL, EXIT, PONG = 0, 1, 2, 3, 4, 5
# kernel -> relay (PING: the kernel heard nothing for a while; a relay that does not answer PONG is taken for hung)
JOB, SIGNAL, KILL, PING = 1, 2, 3, 4
# the marker check (``base.RootCheck``): the kernel asks CHECK {"path", "token"}, the relay answers SEES {"sees"}
CHECK = SEES = 9
# the direct channel (``slurm_bulk``): the kernel asks OPEN {"host", "port", "key"}, the relay connects and answers
# OPENED {"ok", "error"}; then BULK, either way, says that the next frame on the channel is the data of a JOB
# (kernel -> relay) or of CTRL (relay -> kernel) at this point of the stream
OPEN, OPENED, BULK = 5, 6, 7
BULK_MIN = 1 << 16  # bytes: less goes in the line itself


def encode_line(tag: int, data: bytes | memoryview) -> bytes:
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
        self.bulk: slurm_bulk.Channel | None = None  # the direct channel, once the kernel opened it
        r, w = os.pipe()
        with contextlib.suppress(OSError):  # results in chunks of up to 1 MiB (Linux's default most), not 64 KiB
            import fcntl

            fcntl.fcntl(r, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
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
        with contextlib.suppress(OSError):  # jobs to the worker in pieces of up to 1 MiB too
            import fcntl

            fcntl.fcntl(self.proc.stdin.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)  # type: ignore[union-attr]
        self.emit(INFO, json.dumps({
            "pid": self.proc.pid, "relay_pid": os.getpid(), "hostname": socket.gethostname(),
            "node": where["GPULEASE_NODE"], "job_id": where["GPULEASE_SLURM_JOB_ID"],
            "step_id": where["GPULEASE_SLURM_STEP_ID"], "cuda_visible_devices": self.visible,
            "comm_host": os.environ.get("SLURM_SRUN_COMM_HOST", ""),  # the address this node reaches srun on
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
        lost = False  # the direct channel failed: what the worker still sends has nowhere to go
        while True:
            try:
                data = os.read(fd, 1 << 20 if tag == CTRL else 1 << 16)
            except OSError:
                data = b""
            if tag == CTRL and data and (lost or (self.bulk is not None and len(data) >= BULK_MIN)):
                if not lost:
                    try:  # the line first: the kernel reads the frame when it comes to it, in order
                        self.emit(BULK, b"")
                        self.bulk.send(data, 60.0)  # type: ignore[union-attr]  # (reads of 1 MiB: one frame)
                    except OSError as e:  # the cell's results cannot reach the kernel any more: end it
                        lost = True
                        sys.stderr.write(f"gpulease relay: the bulk channel failed: {e}\n")
                        threading.Thread(target=self.kill, args=(0.0,), daemon=True).start()
                continue
            with contextlib.suppress(OSError):
                self.emit(tag, data)
            if not data:
                if tag == CTRL:
                    os.close(fd)
                return

    def _lines(self) -> Iterator[bytes]:
        """srun's stdin, a line at a time, read from the descriptor itself: a thread blocked in
        ``sys.stdin.buffer.readline()`` holds the buffer's lock, and the interpreter's shutdown, which closes
        ``sys.stdin``, waits a second for it and then aborts (SIGABRT: "could not acquire lock ... at interpreter
        shutdown, possibly due to daemon threads")."""
        parts: list[bytes] = []  # of the line not yet complete (a job's lines may be long)
        while True:
            try:
                data = os.read(0, 1 << 20)
            except OSError:
                data = b""
            if not data:
                return
            start = 0
            while (end := data.find(b"\n", start)) >= 0:
                parts.append(data[start:end])
                yield b"".join(parts)
                parts, start = [], end + 1
            if start < len(data):
                parts.append(data[start:])

    def _input(self) -> None:
        for line in self._lines():
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
            elif tag == PING:
                with contextlib.suppress(OSError):
                    self.emit(PONG, data)
            elif tag == CHECK:
                ask = json.loads(data)
                with contextlib.suppress(OSError):
                    self.emit(SEES, json.dumps({"sees": sees_marker(ask["path"], ask["token"])}).encode())
            elif tag == OPEN:
                self._open(json.loads(data))
            elif tag == BULK:
                try:
                    assert self.bulk is not None
                    frame = self.bulk.recv(60.0)
                except (AssertionError, OSError) as e:  # refused (or lost): the worker's lifeline closes
                    sys.stderr.write(f"gpulease relay: the kernel's data on the direct channel was refused: {e}\n")
                    break
                with contextlib.suppress(OSError, ValueError):
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(frame)
                    self.proc.stdin.flush()
        with contextlib.suppress(OSError, ValueError):  # the kernel is gone: the worker's lifeline closes
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def _open(self, ask: dict[str, object]) -> None:
        """Connect to the kernel's end of the direct channel; the key came on stdin and stays in this process."""
        try:
            key = bytes.fromhex(str(ask["key"]))
            self.bulk = slurm_bulk.connect(str(ask["host"]), int(str(ask["port"])), key, 10.0)
            answer = {"ok": True, "error": ""}
        except (OSError, ValueError, KeyError) as e:
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        with contextlib.suppress(OSError):
            self.emit(OPENED, json.dumps(answer).encode())

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
    rc = relay.run()
    # everything went out with os.write (EXIT last): leave without the interpreter's teardown, so that the step
    # ends, and srun and the kernel learn it, the moment the worker is gone
    os._exit(rc)


if __name__ == "__main__":
    main()

"""The Slurm executor's direct channel for bulk data: one TCP connection between the kernel and the step's relay.

srun's own stdio carries lines only, base64 and through slurmstepd (about 11 MB/s for a 200 MB value); a node
that does not see the kernel's artifact root gets its large values and sends its results through this channel
instead. It uses the standard library only (the relay imports nothing heavy):

- the kernel listens on an ephemeral port (or one of ``SlurmExecutor.bulk_ports``) bound to the address the node
  reaches srun on (``SLURM_SRUN_COMM_HOST``, which the relay reports), and sends the relay a new random key
  through srun's stdin, which only the kernel and the step see: never in argv, the environment, or a log;
- the kernel accepts connections until one proves the key (a challenge-response both ways, ``hmac``; compared
  with ``hmac.compare_digest``), then stops listening; a connection that does not prove it is closed;
- every frame carries its length (at most ``MAX_FRAME``), its sequence number and direction, and an HMAC-SHA256
  over all of them with a key derived for this connection: a frame that is altered, replayed, reordered, or
  comes from the other direction is refused, and the channel with it.

Which bytes go through it, and in what order relative to srun's lines, is the kernel's and the relay's business
(``slurm``, ``slurm_relay``): each frame is announced by a line on srun's stdio (``BULK``), so output and results
keep their order.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Callable

MAX_FRAME = 4 << 20  # bytes of payload per frame: what a reader allocates before the frame proved itself
KEY_BYTES = 32
_MAC = hashlib.sha256().digest_size
_HEAD = struct.Struct("!QI")  # sequence number, payload length
_TO_RELAY, _TO_KERNEL = b"k>r", b"r>k"


class BulkError(OSError):
    """The channel failed: a peer that did not prove the key, a frame that did not authenticate, a short read."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def _mac(key: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    m = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        m.update(p)
    return m.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise BulkError("the bulk channel closed mid-frame")
        got += k
    return buf


class Channel:
    """One authenticated connection; ``send`` and ``recv`` frames (each direction by one thread at a time)."""

    def __init__(self, sock: socket.socket, key: bytes, kernel: bool) -> None:
        self.sock, self._key = sock, key
        self._out, self._in = (_TO_RELAY, _TO_KERNEL) if kernel else (_TO_KERNEL, _TO_RELAY)
        self._sent = self._received = 0
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes | memoryview, timeout: float | None = None) -> None:
        """``data`` as one frame (at most ``MAX_FRAME`` bytes); ``timeout``: for the whole frame."""
        if len(data) > MAX_FRAME:
            raise ValueError(f"a bulk frame carries at most {MAX_FRAME} bytes")
        head = _HEAD.pack(self._sent, len(data))
        self._sent += 1
        self.sock.settimeout(timeout)
        self.sock.sendall(head)
        self.sock.sendall(data)
        self.sock.sendall(_mac(self._key, self._out, head, data))

    def recv(self, timeout: float | None = None) -> bytearray:
        """The next frame's payload, once it proved itself; ``BulkError`` (the channel is closed) otherwise."""
        self.sock.settimeout(timeout)
        try:
            head = bytes(_recv_exact(self.sock, _HEAD.size))
            seq, n = _HEAD.unpack(head)
            if seq != self._received or n > MAX_FRAME:
                raise BulkError(f"bulk frame {seq} of {n} bytes refused (expected frame {self._received}, "
                                f"at most {MAX_FRAME} bytes)")
            data = _recv_exact(self.sock, n)
            tag = bytes(_recv_exact(self.sock, _MAC))
        except BaseException:
            self.close()
            raise
        if not hmac.compare_digest(tag, _mac(self._key, self._in, head, data)):
            self.close()
            raise BulkError(f"bulk frame {seq} refused: it does not authenticate")
        self._received += 1
        return data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# ------------------------------------------------------------------------------ kernel side
class Listener:
    """The kernel's end: listens on ``host`` (a port of ``ports``, else an ephemeral one) for the relay."""

    def __init__(self, host: str, ports: tuple[int, int] | None = None) -> None:
        self.key = new_key()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._bind(host, ports)
            self.sock.listen(4)
        except BaseException:
            self.sock.close()
            raise
        self.port = int(self.sock.getsockname()[1])

    def _bind(self, host: str, ports: tuple[int, int] | None) -> None:
        if not ports:
            self.sock.bind((host, 0))
            return
        for port in range(ports[0], ports[1] + 1):
            try:
                self.sock.bind((host, port))
                return
            except OSError:
                continue
        raise OSError(f"no free port in {ports[0]}-{ports[1]} on {host} (SlurmExecutor.bulk_ports)")

    def accept(self, timeout: float, given_up: Callable[[], bool] | None = None) -> Channel:
        """The first connection within ``timeout`` that proves the key; the listener is closed either way.
        ``given_up()``: the relay said it could not connect (stop waiting)."""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                if given_up is not None and given_up():
                    break
                self.sock.settimeout(min(left, 0.05))
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    continue
                try:
                    return self._prove(conn, min(max(deadline - time.monotonic(), 0.5), 2.0))
                except (OSError, ValueError):
                    conn.close()  # not our relay: keep listening for it
            raise BulkError("the relay did not connect to the kernel's bulk channel")
        finally:
            self.sock.close()

    def _prove(self, conn: socket.socket, timeout: float) -> Channel:
        conn.settimeout(timeout)
        mine = os.urandom(32)
        conn.sendall(mine)
        answer = bytes(_recv_exact(conn, 32 + _MAC))
        theirs, tag = answer[:32], answer[32:]
        if not hmac.compare_digest(tag, _mac(self.key, b"relay", mine, theirs)):
            raise BulkError("a connection to the bulk channel did not prove the key")
        conn.sendall(_mac(self.key, b"kernel", mine, theirs))
        return Channel(conn, _mac(self.key, b"frames", mine, theirs), kernel=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# ------------------------------------------------------------------------------ relay side
def connect(host: str, port: int, key: bytes, timeout: float) -> Channel:
    """The relay's end: connect to the kernel and prove the key both ways."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.settimeout(timeout)
        theirs = bytes(_recv_exact(sock, 32))
        mine = os.urandom(32)
        sock.sendall(mine + _mac(key, b"relay", theirs, mine))
        tag = bytes(_recv_exact(sock, _MAC))
        if not hmac.compare_digest(tag, _mac(key, b"kernel", theirs, mine)):
            raise BulkError("the kernel's end of the bulk channel did not prove the key")
    except BaseException:
        sock.close()
        raise
    return Channel(sock, _mac(key, b"frames", theirs, mine), kernel=False)

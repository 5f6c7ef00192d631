"""Notifications: a webhook receiver that never answers must not slow grants.

Two real brokers side by side, each with 4 simulated GPUs: one sends every lease's end to a webhook that accepts
connections and never answers (each attempt waits out ``Notifier.timeout_seconds``, then is retried), the other
has no notifier. Rounds alternate between them, so drift hits both alike. Each sample is one ``POST /leases``
answered granted; the lease is then revoked, which is a message to the hanging receiver.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from typing import Any

from .broker_process import Broker, Conn
from .report import Figure, figure

TITLE = "Notifications"


async def _grants(path: str, n: int) -> list[float]:
    conn = await Conn.open(path)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            status, lease = await conn.call("POST", "/api/v1/leases", {"gpus": 1, "heartbeat": False})
            out.append((time.perf_counter() - t0) * 1000)
            if status != 201:
                raise RuntimeError(f"not granted: {status} {lease}")
            await conn.call("POST", f"/api/v1/leases/{lease['id']}/revoke", {"reason": "bench"})
    finally:
        conn.close()
    return out


def run(opts: Any) -> list[Figure]:
    quick = bool(getattr(opts, "quick", False))
    rounds, per = (2, 20) if quick else (10, 100)
    tmp = tempfile.mkdtemp(prefix="glnotify")
    hang = socket.socket()  # accepts connections (the backlog) and never answers
    hang.bind(("127.0.0.1", 0))
    hang.listen(4096)
    cfg = os.path.join(tmp, "notify.py")
    me = "root" if os.geteuid() == 0 else os.environ.get("USER", "")
    with open(cfg, "w") as f:
        f.write(f"c.Notifier.webhooks = {{{me!r}: 'http://127.0.0.1:{hang.getsockname()[1]}/hook'}}\n"
                "c.Notifier.timeout_seconds = 2\nc.Notifier.backoff_seconds = 1\n")
    with_hook, plain = Broker(os.path.join(tmp, "hook"), 4, 1), Broker(os.path.join(tmp, "plain"), 4, 1)
    with_hook.args.append(f"--config={cfg}")
    hooked: list[float] = []
    base: list[float] = []
    try:
        for b in (with_hook, plain):
            os.makedirs(b.workdir)
            b.start()
        for _ in range(rounds):
            hooked += asyncio.run(_grants(with_hook.socket, per))
            base += asyncio.run(_grants(plain.socket, per))
        hooked.sort()
        base.sort()
        p99, bp99 = hooked[int(0.99 * (len(hooked) - 1))], base[int(0.99 * (len(base) - 1))]
    finally:
        with_hook.stop()
        plain.stop()
        hang.close()
    return [
        figure("grant of a free GPU, every lease's end sent to a webhook that never answers", "ms", hooked,
               "the same broker without notifications", base, bar=None,
               note=f"{rounds} rounds of {per} grants on each broker, alternating; each lease is revoked after its "
                    "grant, a message to the receiver (timeout 2 s, then retried). Command: "
                    "`python -m benchmarks --only notify`."),
        figure("grant p99 with the hanging receiver / without", "ratio", [p99 / bp99], "equal", [1.0],
               bar=("max", "<=", 2.0), note=f"p99 {p99:.2f} ms with, {bp99:.2f} ms without (same run)."),
    ]

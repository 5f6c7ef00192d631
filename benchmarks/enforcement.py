"""How late the broker takes back a GPU: idle revocation and expiry past their deadlines.

A real broker with the default enforcement tick (``LeaseBroker.tick_seconds``, 1 s) grants short leases
with no processes attached; each sample is how long after its deadline (last activity + idle timeout,
or grant + duration) the lease's state becomes ``revoked``/``expired``, seen from a client polling the
lease every 5 ms. The deadline is taken from the broker's own timestamps on the lease.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from typing import Any

from .broker_process import Broker, Conn
from .report import Figure, figure

TITLE = "Idle revocation and expiry"


async def _delay(path: str, body: dict[str, Any], deadline_of: str) -> float:
    """Seconds from the lease's deadline (broker clock) to the moment the client sees it ended."""
    conn = await Conn.open(path)
    try:
        status, lease = await conn.call("POST", "/api/v1/leases", {"gpus": 1, "heartbeat": False, **body})
        if status >= 300 or lease["state"] != "granted":
            raise RuntimeError(f"lease not granted at once: {status} {lease}")
        # the broker's wall-clock times; this process shares the clock
        deadline = lease["idle_deadline"] if deadline_of == "idle" else lease["expires_at"]
        if deadline is None:
            raise RuntimeError(f"the lease view has no {deadline_of} deadline: {lease}")
        while True:
            _, view = await conn.call("GET", f"/api/v1/leases/{lease['id']}")
            if view["phase"] == "ended":
                seen = time.time()
                want = "revoked" if deadline_of == "idle" else "expired"
                if view["state"] != want:
                    raise RuntimeError(f"lease ended {view['state']} ({view.get('reason')}), expected {want}")
                return seen - float(deadline)
            await asyncio.sleep(0.005)
    finally:
        conn.close()


async def _many(path: str, n: int, body: dict[str, Any], deadline_of: str) -> list[float]:
    # staggered starts so the deadlines fall at different phases of the broker's tick
    async def one(i: int) -> float:
        await asyncio.sleep(i * 0.137)
        return await _delay(path, body, deadline_of)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def run(opts: Any) -> list[Figure]:
    n = 5 if opts.quick else 20
    tmp = tempfile.mkdtemp(prefix="glenf")
    try:
        b = Broker(os.path.join(tmp, "b"), gpus=max(8, n), nodes=1)
        os.makedirs(b.workdir)
        b.start()
        try:
            idle = asyncio.run(_many(b.socket, n, {"idle_timeout_seconds": 2, "duration_seconds": 600}, "idle"))
            expiry = asyncio.run(_many(b.socket, n, {"duration_seconds": 2, "idle_timeout_seconds": 600}, "expiry"))
        finally:
            b.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [
        figure(
            "idle revocation: delay past the idle deadline", "s", idle,
            "expiry: delay past the time limit (same broker)", expiry, bar=("p99", "<=", 1.5),
            note=f"{n} 1-GPU leases with a 2 s idle timeout and nothing attached (so idle from the grant), started "
                 "0.137 s apart; the broker's enforcement tick is its default, 1 s, so the expected delay is "
                 "uniform in [0, 1] s plus a poll. Bar: one tick plus 0.5 s.",
        ),
    ]

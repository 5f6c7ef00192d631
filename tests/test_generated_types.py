"""The clients' lease types are generated from the ``Lease`` schema of openapi.json: they never drift from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_lease_types_match_the_schema() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_types.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_real_brokers_views_say_their_phase(client) -> None:
    """``phase`` says queued, holding or ended, so that no client lists state names; the generated ``LeaseView``
    reads every view a real broker sends."""
    holder = client.request_lease(4, heartbeat=False)
    waiting = client.request_lease(1, heartbeat=False)
    assert (holder.state, holder.phase, holder.holding) == ("granted", "holding", True)
    assert (waiting.state, waiting.phase, waiting.holding, waiting.ended) == ("queued", "queued", False, False)
    ended = client.release(holder.id)
    assert (ended.phase, ended.ended, ended.holding) == ("ended", True, False) and ended.reason_text
    assert {lease.phase for lease in client.leases()} <= {"queued", "holding"}
    client.release(waiting.id)  # granted once the holder went, or cancelled: either way it ends
    assert client.lease(waiting.id).phase == "ended"

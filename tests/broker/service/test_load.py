"""Load: 1,000 concurrent clients request and release leases for 10 s against a real broker.

The 60 s version and the %%gpu soak run in ``make soak`` (``python -m benchmarks --only load``), which
writes the figures to BENCHMARKS.md. Latencies are printed, never asserted (the machine is shared);
what is asserted is what must hold under any load: no error, no double grant, nothing lost.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the benchmarks package

from benchmarks.load import LoadConfig, run_load


def test_1000_clients_for_10s_zero_errors_zero_double_grants_nothing_lost(tmp_path: Path) -> None:
    # 128 GPUs: the clients ask for about twice that at once, so requests queue however fast the broker grants
    r = run_load(LoadConfig(clients=1000, seconds=float(os.environ.get("GPULEASE_LOAD_SECONDS", 10)), gpus=128,
                            nodes=16), str(tmp_path / "load"))
    s = r.summary()
    print(json.dumps({k: s[k] for k in ("requests", "granted", "released", "cancelled", "max_queued",
                                        "grant_ms", "answer_ms", "broker_cpu_s")}, indent=1))
    assert r.errors == [], r.errors[:10]
    assert r.client_double_grants == [] and r.store_double_grants == []
    assert r.lost == [], r.lost[:10]
    assert r.broker_log_errors == [], r.broker_log_errors
    # it was load: every client connected and most got GPUs, queueing happened, the store saw it all
    assert r.granted >= 500 and r.requests == r.store_leases and r.max_queued > 0
    assert r.released + r.cancelled == r.requests

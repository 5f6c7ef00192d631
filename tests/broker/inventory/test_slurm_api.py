"""The Python API (``lease``, ``on_gpu``, ``map``) through the executor of the lease's placement on Slurm: a REAL local
Slurm (tests/slurm_cluster.py), a REAL broker with ``--inventory=slurm`` and a REAL kernel (tests/kernels.py). Needs
root; skipped with the reason otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import waiting
from broker_process import BrokerProcess
from remote_fixtures import kernel_of, running, slurm_broker
from slurm_cluster import LocalSlurmCluster, slurm_missing

pytestmark = [pytest.mark.skipif(bool(slurm_missing()), reason=slurm_missing() or "slurm"), pytest.mark.timeout(300)]

T = 30.0

wait_for = functools.partial(waiting.wait_for, timeout=T, interval=0.02)


@pytest.fixture(scope="module")
def broker(slurm_cluster: LocalSlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with running(slurm_broker(slurm_cluster, tmp_path_factory.mktemp("slurm-api-broker"), timeout=T),
                 then=slurm_cluster.cancel_all) as b:
        yield b


@pytest.fixture(scope="module")
def kernel(slurm_cluster: LocalSlurmCluster, broker: BrokerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with kernel_of(broker, tmp_path_factory.mktemp("slurm-api-artifacts"), slurm_cluster.env) as k:
        yield k


def test_api_lease_on_gpu_and_map_run_as_slurm_steps(kernel: Any, broker: BrokerProcess,
                                                    slurm_cluster: LocalSlurmCluster) -> None:
    r = kernel.run(
        "import os, jupyter_gpulease\n"
        "def where(x):\n"
        "    return (os.environ.get('SLURM_JOB_ID'), os.environ.get('SLURMD_NODENAME'),\n"
        "            'slurm_relay' in open(f'/proc/{os.getppid()}/cmdline').read(), x * 2)\n"
        "with jupyter_gpulease.lease(2) as held:\n"
        "    a = held.run(where, 1)\n    kind = held.info.placement['kind']\n"
        "print('lease', kind, bool(a[0]), a[1], a[2], a[3])\n"
        "print('one', *jupyter_gpulease.on_gpu(1)(where)(5)[2:])\n"
        "res = jupyter_gpulease.map(where, [1, 2, 3], gpus_per_call=1, max_gpus=2)\n"
        "print('map', {s for _, _, s, _ in res}, [v for _, _, _, v in res])\n", timeout=T * 4)
    assert r.status == "ok", r.outputs
    lines = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if line.strip()}
    assert lines["lease"][0] == "slurm" and lines["lease"][1] == "True" and lines["lease"][3:] == ["True", "2"], r.stdout
    assert lines["one"] == ["True", "10"], r.stdout  # started by the relay in the lease's step
    assert "map {True} [2, 4, 6]" in r.stdout, r.stdout
    c = broker.client(timeout=T)
    try:
        wait_for(lambda: not [v for v in c.leases() if v["phase"] != "ended"], what="the API's leases released")
    finally:
        c.close()


WARM_CALLS = (
    "import os, time, statistics, jupyter_gpulease\n"
    "def step(_=None):\n"
    "    import os, time\n"
    "    ticks = int(open(f'/proc/{os.getppid()}/stat').read().rsplit(')', 1)[1].split()[19])  # the relay's start\n"
    "    age = float(open('/proc/uptime').read().split()[0]) - ticks / os.sysconf('SC_CLK_TCK')\n"
    "    time.sleep(0.5)  # a call's work: long enough for the next call's step to start meanwhile\n"
    "    return os.getpid(), os.environ.get('GPULEASE_SLURM_STEP_ID'), time.time() - age\n"
    "calls = []\n"
    "with jupyter_gpulease.lease(1) as held:\n"
    "    for _ in range(6):\n"
    "        t0 = time.time()\n"
    "        pid, step_id, born = held.run(step)\n"
    "        calls.append((t0, time.time() - t0 - 0.5, pid, step_id, born))\n"
    "print('cold', round(statistics.median(c[1] for c in calls[:2]) * 1e3))\n"
    "print('warm', round(statistics.median(c[1] for c in calls[2:]) * 1e3))\n"
    "print('prestarted', sum(born < t0 for t0, _, _, _, born in calls[2:]), len(calls[2:]))\n"
    "print('fresh', len({c[2] for c in calls}), len({c[3] for c in calls}))\n"
)


def test_api_lease_warm_slurm_step_for_the_next_call(kernel: Any, broker: BrokerProcess) -> None:
    """A lease that runs several calls (``lease().run``, ``map``): from its second call on, the next call's step is
    started while the current one runs (``SlurmExecutor.keep_warm``), so the next call finds its relay and a fresh
    worker running, not a new srun; every call still has a worker (and a step) of its own."""
    switch = ("from jupyter_gpulease.kernel import api\nget_ipython().config.SlurmExecutor.keep_warm = {0}\n"
              "if 'slurm' in api._executors:\n    api._executors['slurm'].keep_warm = {0}\n")
    figures = {}
    for warm in (False, True):
        assert kernel.run(switch.format(warm)).status == "ok"
        r = kernel.run(WARM_CALLS, timeout=T * 4)
        assert r.status == "ok", r.outputs
        lines = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if line.strip()}
        assert lines["fresh"] == ["6", "6"], r.stdout  # a fresh worker in a step of its own per call
        figures[warm] = lines
    # the time a call adds to its 0.5 s of work (ms; the first two calls, then calls 3-6), keep_warm off and on
    print("keep_warm off:", figures[False], "on:", figures[True])
    assert figures[True]["prestarted"] == ["4", "4"]  # calls 3-6: their step started before the call
    c = broker.client(timeout=T)
    try:
        wait_for(lambda: not [v for v in c.leases() if v["phase"] != "ended"], what="the API's leases released")
    finally:
        c.close()

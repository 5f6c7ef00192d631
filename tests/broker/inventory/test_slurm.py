"""Multi-node on Slurm: a REAL local Slurm (munged, slurmctld, two slurmd with fake GPUs, all under a temporary
directory: tests/slurm_cluster.py) as the broker's inventory and placement layer, and a REAL broker process
with ``--inventory=slurm``. Slurm's own view (squeue, sinfo, scontrol) is checked from this test process.
Needs root; skipped with the reason otherwise.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waiting
from broker_process import BrokerProcess
from remote_fixtures import kernel_of, release_all, slurm_broker
from slurm_cluster import MAX_TIME_MINUTES, LocalSlurmCluster, local_slurm_cluster, slurm_missing
from users import as_user, second_user  # noqa: F401  (fixture)

from jupyter_gpulease.client import BrokerClient, BrokerError

pytestmark = pytest.mark.timeout(300)

T = 30.0


wait_for = functools.partial(waiting.wait_for, timeout=T, interval=0.02)


def start_broker(cluster: LocalSlurmCluster, workdir: Path, *args: str) -> BrokerProcess:
    return slurm_broker(cluster, workdir, *args, timeout=T)


@pytest.fixture(scope="module")
def cluster(slurm_cluster: LocalSlurmCluster) -> LocalSlurmCluster:
    return slurm_cluster


@pytest.fixture(scope="module")
def broker(cluster: LocalSlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    b = start_broker(cluster, tmp_path_factory.mktemp("slurm-broker"))
    try:
        yield b
    finally:
        b.stop()
        # the allocations of leases that were still held stay for a next broker (as after a crash): cancel them
        cluster.cancel_all()


@pytest.fixture
def client(broker: BrokerProcess, cluster: LocalSlurmCluster) -> Iterator[BrokerClient]:
    c = broker.client(timeout=T)
    yield c
    release_all(c)  # leave nothing held for the next test
    wait_for(lambda: not _live_jobs(cluster), what="Slurm to have no allocation of the broker left")
    wait_for(lambda: c.gpus()["summary"]["free"] == 6, what="the broker to see every GPU drained")
    c.close()


def _live_jobs(cluster: LocalSlurmCluster) -> list[dict[str, str]]:
    return [j for j in cluster.jobs() if j["name"].startswith("gpulease-")]


def _ready(c: BrokerClient, lease: dict[str, Any]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        view = c.lease(lease["id"])
        assert view["phase"] != "ended", view
        return view if (view.get("placement") or {}).get("state") == "ready" else None

    return wait_for(check, what=f"the Slurm allocation of {lease['id']}")  # type: ignore[no-any-return]


def _job(cluster: LocalSlurmCluster, lease: dict[str, Any]) -> dict[str, str]:
    jobs = [j for j in cluster.jobs() if j["name"] == "gpulease-" + lease["id"]]
    assert len(jobs) == 1, jobs
    return jobs[0]


def _slurm_gpus(cluster: LocalSlurmCluster, job_id: str) -> list[str]:
    """The GPUs Slurm gave a job, as the broker names them (``slurm:<node>:<index>``)."""
    from lease_broker.inventory.slurm_cli import _IDX_RE, expand_hostlist, expand_indices

    text = cluster.run("scontrol", "--details", "show", "job", job_id)
    return sorted(f"slurm:{node}:{i}" for m in _IDX_RE.finditer(text) for node in expand_hostlist(m.group(1))
                  for i in expand_indices(m.group(2)))


def _ids(lease: dict[str, Any]) -> list[str]:
    return sorted(d["id"] for d in lease["devices"])


# ------------------------------------------------------------------------------ inventory and allocations
def test_inventory_is_the_slurm_partition(client: BrokerClient) -> None:
    ids = [g["id"] for g in client.gpus()["gpus"]]
    assert ids == [f"slurm:n1:{i}" for i in range(4)] + [f"slurm:n2:{i}" for i in range(2)]
    inv = client.info()["inventory"]
    assert inv["kind"] == "slurm" and inv["simulated"] is False
    assert inv["cluster"] == "gpulease-test" and inv["partition"] == "gpu" and inv["nodes"] == 2


def test_each_lease_is_an_allocation_on_distinct_devices(client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    a = _ready(client, client.request_lease(2, wait=T))
    b = _ready(client, client.request_lease(2, wait=T))
    assert a["node"] == "n2" and b["node"] == "n1"  # best fit: the 2-GPU node first
    c = _ready(client, client.request_lease(2, wait=T))
    assert c["node"] == "n1"
    leases = (a, b, c)
    assert len({d for lease in leases for d in _ids(lease)}) == 6  # distinct devices: all six GPUs
    assert cluster.free_gpus() == 0
    for lease in leases:
        p = lease["placement"]
        job = _job(cluster, lease)
        assert p["kind"] == "slurm" and p["job_name"] == "gpulease-" + lease["id"] and p["job_id"] == job["id"]
        assert job["state"] == "RUNNING" and job["nodes"] == lease["node"]
        assert _slurm_gpus(cluster, job["id"]) == _ids(lease)  # the broker's devices are the ones Slurm gave
        assert p["bundles"] == [{"index": 0, "node": lease["node"], "gpus": 2,
                                 "indices": sorted(int(d.rsplit(":", 1)[1]) for d in _ids(lease))}]
        assert lease["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(str(i) for i in p["bundles"][0]["indices"])


def test_allocations_are_charged_to_the_leases_unix_user(cluster: LocalSlurmCluster, tmp_path: Path,
                                                          second_user: Any) -> None:  # noqa: F811
    """The broker runs as root: a lease of another Unix user is that user's Slurm job (salloc --uid/--gid), so
    Slurm's accounting and fair share charge them; the broker still sees it, adopts it and cancels it."""
    import tempfile

    shared = tempfile.mkdtemp(prefix="gl-slurm")
    os.chmod(shared, 0o755)  # the second user reaches the socket
    b = BrokerProcess(tmp_path / "charge", socket_path=os.path.join(shared, "b.sock"), env=cluster.env,
                      args=["--inventory=slurm", "--tick=0.2", "--SlurmInventory.placement_timeout=10",
                            "--SlurmInventory.job_prefix=glcharge"]).start(timeout=T)
    try:
        url = b.url

        def theirs() -> dict[str, Any]:
            c = BrokerClient(url)
            return dict(c.request_lease(1, heartbeat=False, wait=T).raw)

        lease = as_user(second_user, theirs)
        assert lease.get("state") == "granted", lease
        root = b.client(timeout=T)
        wait_for(lambda: (root.lease(lease["id"]).get("placement") or {}).get("state") == "ready",
                 what="the second user's allocation")
        owners = cluster.run("squeue", "-h", "-o", "%j|%u")
        assert f"glcharge-{lease['id']}|{second_user.pw_name}" in owners.splitlines(), owners
        b.stop()  # a restarted broker finds the user's job again by name
        b.start(timeout=T)
        assert (root.lease(lease["id"]).get("placement") or {}).get("state") == "ready"
        root.release(lease["id"])  # root ends the user's job
        wait_for(lambda: f"glcharge-{lease['id']}" not in cluster.run("squeue", "-h", "-o", "%j"),
                 what="the user's job to leave Slurm")
    finally:
        b.stop()


def test_release_frees_the_allocation_in_slurm(client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    lease = _ready(client, client.request_lease(4, wait=T))
    job = _job(cluster, lease)
    t0 = time.monotonic()
    client.release(lease["id"])
    wait_for(lambda: not [j for j in cluster.jobs() if j["id"] == job["id"]], timeout=5,
             what="squeue to no longer list the released lease's job")
    assert time.monotonic() - t0 < 5
    assert cluster.free_gpus() == 6
    assert client.lease(lease["id"])["placement"] is None
    # the GPUs drained (Slurm freed them) and go straight to the next lease
    again = _ready(client, client.request_lease(4, wait=T))
    assert _ids(again) == _ids(lease)


def test_gang_across_nodes_is_one_allocation_on_both(client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    lease = _ready(client, client.request_lease(6, wait=T, locality="any"))
    assert {d["node"] for d in lease["devices"]} == {"n1", "n2"}
    job = _job(cluster, lease)
    assert job["state"] == "RUNNING" and job["nodes"] == "n[1-2]"  # one job, -N2
    assert _slurm_gpus(cluster, job["id"]) == _ids(lease)
    assert [(b["node"], b["gpus"]) for b in lease["placement"]["bundles"]] == [("n1", 4), ("n2", 2)]
    assert cluster.free_gpus() == 0


def test_equal_gang_across_nodes_uses_gres_per_node(client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    _ready(client, client.request_lease(2, wait=T))  # n2 is full; n1 has 4
    blocker = _ready(client, client.request_lease(2, wait=T))  # n1: 2 left
    assert blocker["node"] == "n1"
    client.release(next(v for v in client.leases() if v["node"] == "n2" and v["phase"] != "ended")["id"])
    lease = _ready(client, client.request_lease(4, wait=T, locality="any"))  # 2 + 2
    assert sorted(b["gpus"] for b in lease["placement"]["bundles"]) == [2, 2]
    assert _job(cluster, lease)["nodes"] == "n[1-2]"
    assert _slurm_gpus(cluster, _job(cluster, lease)["id"]) == _ids(lease)


def test_gang_that_fits_nowhere_waits_and_holds_nothing(client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    # 2 GPUs (best fit: n2) and 1 (n1) held: 3 free, but no node has 4 free
    held = [_ready(client, client.request_lease(n, wait=T)) for n in (2, 1)]
    lease = client.request_lease(4, wait=1, locality="node")
    assert lease["state"] == "queued" and lease["placement"] is None
    assert len(_live_jobs(cluster)) == 2  # nothing allocated for the waiting gang
    assert cluster.free_gpus() == 3
    for n, locality in ((5, "node"), (7, "any")):  # never grantable: refused at once, naming why
        with pytest.raises(BrokerError) as e:
            client.request_lease(n, wait=0, locality=locality)
        assert e.value.status == 400 and "can never be granted" in str(e.value)
    client.release(lease["id"])
    assert client.lease(lease["id"])["state"] == "cancelled"
    for h in held:
        client.release(h["id"])
    wait_for(lambda: not _live_jobs(cluster), what="the allocations to be cancelled")


def test_slurm_limits_are_respected_and_named_in_the_reason(client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    # the partition allows MAX_TIME_MINUTES: a longer lease is granted by the broker, refused by Slurm
    lease = client.request_lease(1, wait=T, duration_seconds=(MAX_TIME_MINUTES + 60) * 60)
    ended = wait_for(lambda: (v := client.lease(lease["id"]))["state"] == "failed" and v,
                     what="the lease to fail on Slurm's limit")
    assert ended["reason"].startswith("slurm_refused: job ")
    # Slurm's reason code and its own words: the time asked exceeds the partition's MaxTime
    # (Slurm first says PartitionConfig, once its scheduler has looked PartitionTimeLimit)
    assert re.search(r"pending \(Partition(Config|TimeLimit)\): Requested partition configuration not available now",
                     ended["reason"]), ended["reason"]
    assert f"asked for {MAX_TIME_MINUTES + 60 + 2} min" in ended["reason"]  # + the 120 s margin
    wait_for(lambda: not _live_jobs(cluster), what="the refused job to be cancelled")
    assert cluster.free_gpus() == 6


# ------------------------------------------------------------------------------ %%gpu through srun
@pytest.fixture(scope="module")
def kernel(cluster: LocalSlurmCluster, broker: BrokerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with kernel_of(broker, tmp_path_factory.mktemp("slurm-artifacts"), cluster.env) as k:
        yield k


def test_gpu_cell_runs_as_a_slurm_step_with_live_output(kernel: Any, client: BrokerClient,
                                                         cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    go = tmp_path / "go"
    code = (
        "%%gpu 2 --out where\n"
        "import os, socket, time\n"
        "print('started', flush=True)\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.02)\n"
        "where = {k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'GPULEASE_LEASE_ID', 'GPULEASE_NODE',\n"
        "                                         'SLURM_JOB_ID', 'SLURMD_NODENAME')}\n"
        "where['ppid_cmd'] = open(f'/proc/{os.getppid()}/cmdline').read()\n"
        "print('done', flush=True)\n"
    )
    msg_id = kernel.submit(code)
    # live: the first line arrives while the cell still waits for us
    partial = kernel.collect(msg_id, timeout=60, until=lambda outs: any(
        "started" in o["content"].get("text", "") for o in outs))
    assert partial.status == "partial"
    lease = next(v for v in client.leases() if v["phase"] != "ended")
    assert lease["placement"]["kind"] == "slurm" and lease["node"] == "n2"
    job = _job(cluster, lease)
    steps = cluster.run("squeue", "--steps", "--noheader", f"--jobs={job['id']}", "--format=%i|%j")
    assert "gpulease-cell" in steps  # the worker is a step of the lease's allocation
    go.touch()
    r = kernel.collect(msg_id, timeout=60)
    assert r.status == "ok", (r.outputs, r.reply)
    assert "done" in r.stdout
    where = eval(kernel.run("where").result or "{}")  # a dict repr of plain values
    assert where["GPULEASE_LEASE_ID"] == lease["id"]
    assert where["SLURM_JOB_ID"] == job["id"]
    assert where["GPULEASE_NODE"] == where["SLURMD_NODENAME"] == "n2"
    assert where["CUDA_VISIBLE_DEVICES"] == "0,1"  # as Slurm set it for the step on n2
    assert "jupyter_gpulease.executors.slurm_relay" in where["ppid_cmd"]  # started by the relay in the step
    ended = wait_for(lambda: (v := client.lease(lease["id"]))["state"] == "released" and v, what="lease released")
    assert ended["placement"] is None
    wait_for(lambda: not _live_jobs(cluster), what="the allocation to end with the lease")


def test_session_keeps_its_step_worker_across_cells(kernel: Any, client: BrokerClient,
                                                    cluster: LocalSlurmCluster) -> None:
    r1 = kernel.run("%%gpu 1 --session sl\nimport os\nmodel = [1, 2, 3]\nprint(os.getpid(), os.environ['GPULEASE_NODE'])",
                    timeout=60)
    assert r1.status == "ok", (r1.outputs, r1.reply)
    r2 = kernel.run("%%gpu --session sl\nmodel.append(4)\nprint(os.getpid(), model)", timeout=60)
    assert r2.status == "ok", (r2.outputs, r2.reply)
    pid, node = r1.stdout.split()[:2]
    assert node == "n2" and r2.stdout.split()[0] == pid and "[1, 2, 3, 4]" in r2.stdout, (r1.stdout, r2.stdout)
    lease = next(v for v in client.leases() if v["phase"] != "ended")
    assert lease["placement"]["kind"] == "slurm"
    kernel.run("%gpu session stop sl")
    wait_for(lambda: not waiting.process_alive(int(pid)), what="the session's worker to be stopped")
    wait_for(lambda: client.lease(lease["id"])["state"] == "released", what="the session's lease released")
    wait_for(lambda: not _live_jobs(cluster), what="the session's allocation to end")


def test_revoke_kills_the_step(kernel: Any, client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    code = (
        "%%gpu 2\n"
        "import os, subprocess, time\n"
        "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "print('pids', os.getpid(), child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    msg_id = kernel.submit(code)
    partial = kernel.collect(msg_id, timeout=60, until=lambda outs: any(
        "pids" in o["content"].get("text", "") for o in outs))
    line = next(o["content"]["text"] for o in partial.outputs if "pids" in o["content"].get("text", ""))
    pids = [int(p) for p in line.split()[1:3]]
    lease = next(v for v in client.leases() if v["phase"] != "ended")
    job = _job(cluster, lease)
    client.revoke(lease["id"], "test")
    r = kernel.collect(msg_id, timeout=60)
    assert r.status == "error"
    assert r.error is not None and "WorkerCrashed" in r.error["ename"] + str(r.error.get("evalue"))
    wait_for(lambda: not any(waiting.process_alive(p) for p in pids), what="the worker and its child to be killed")
    wait_for(lambda: not [j for j in cluster.jobs() if j["id"] == job["id"]], what="the job to leave squeue")
    assert client.lease(lease["id"])["reason"].startswith("admin")


def test_interrupt_reaches_the_cell_in_the_step(kernel: Any, client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    msg_id = kernel.submit(
        "%%gpu --grace 3s\nimport os, time\nprint('worker', os.getpid(), flush=True)\nn = 0\n"
        "while True:\n    time.sleep(0.05)\n    n += 1\n    if n == 3:\n        print('in the loop', flush=True)")
    # once it says so, the cell is in its loop: an interrupt lands in the sleep
    partial = kernel.collect(msg_id, timeout=60, until=lambda outs: "in the loop" in "".join(
        o["content"].get("text", "") for o in outs))
    pid = int(partial.stdout.split("worker ")[1].split()[0])
    lease = next(v for v in client.leases() if v["phase"] != "ended")
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id, timeout=60)
    assert r.status == "error" and r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    assert "time.sleep(0.05)" in "\n".join(r.error["traceback"])  # the worker's own traceback, through srun
    wait_for(lambda: not waiting.process_alive(pid), what="the worker to exit")
    wait_for(lambda: client.lease(lease["id"])["state"] == "released", what="the lease released")
    wait_for(lambda: not _live_jobs(cluster), what="the allocation to end")


def test_kernel_death_ends_the_step(cluster: LocalSlurmCluster, broker: BrokerProcess, client: BrokerClient,
                                   tmp_path: Path) -> None:
    from kernels import Kernel

    k = Kernel(broker.url, str(tmp_path / "artifacts"), cluster.env)
    try:
        msg_id = k.submit("%%gpu\nimport os, time\nprint('worker', os.getpid(), flush=True)\ntime.sleep(600)")
        partial = k.collect(msg_id, timeout=60, until=lambda outs: any(
            "worker " in o["content"].get("text", "") for o in outs))
        pid = int(partial.stdout.split("worker ")[1].split()[0])
        lease = next(v for v in client.leases() if v["phase"] != "ended")
        job = _job(cluster, lease)
        k.kill9()
        wait_for(lambda: not waiting.process_alive(pid), timeout=10, what="the worker to die with its kernel (its lifeline)")
        # the broker watches the kernel's process: its lease ends at once, not after the heartbeat timeout
        wait_for(lambda: client.lease(lease["id"])["reason"] == "holder_exited", timeout=5, what="the lease ended")
        wait_for(lambda: "gpulease-cell" not in cluster.run("squeue", "--steps", "--noheader",
                                                            f"--jobs={job['id']}", "--format=%j"),
                 timeout=10, what="the step to end")
    finally:
        k.stop()



# ------------------------------------------------------------------------------ restart and node death
def test_broker_restart_keeps_the_allocation(broker: BrokerProcess, client: BrokerClient,
                                             cluster: LocalSlurmCluster) -> None:
    lease = _ready(client, client.request_lease(2, wait=T))
    job = _job(cluster, lease)
    broker.kill9()  # no cleanup code runs
    broker.start(timeout=T)
    client.close()
    again = _ready(client, client.lease(lease["id"]))
    assert again["state"] in ("granted", "active", "idle")
    assert again["placement"]["job_id"] == job["id"]
    assert _job(cluster, lease)["state"] == "RUNNING"
    client.release(lease["id"])
    wait_for(lambda: not _live_jobs(cluster), what="the allocation cancelled at release")


def test_node_down_fails_its_lease_with_the_reason(client: BrokerClient, cluster: LocalSlurmCluster) -> None:
    lease = _ready(client, client.request_lease(2, wait=T))
    assert lease["node"] == "n2"
    job = _job(cluster, lease)
    cluster.node_down("n2", "gpulease test: power lost")
    try:
        ended = wait_for(lambda: (v := client.lease(lease["id"]))["state"] == "failed" and v,
                         what="the lease to fail")
        assert ended["reason"].startswith("node_lost: n2 (")
        assert "power lost" in ended["reason"] and "down" in ended["reason"]
        wait_for(lambda: [g["id"] for g in client.gpus()["gpus"]] == [f"slurm:n1:{i}" for i in range(4)],
                 what="n2's GPUs to leave the inventory")
        wait_for(lambda: not [j for j in cluster.jobs() if j["id"] == job["id"]], what="the job to be gone")
    finally:
        cluster.node_resume("n2")
    wait_for(lambda: len(client.gpus()["gpus"]) == 6, what="n2's GPUs to come back")
    again = _ready(client, client.request_lease(2, wait=T))
    assert again["node"] == "n2"


def test_a_cluster_stops_by_pid_and_leaves_nothing() -> None:
    """A second, throw-away cluster with a running step: stopping it leaves no process and no directory."""
    if slurm_missing():
        pytest.skip(slurm_missing())
    with local_slurm_cluster() as c:
        c.run("salloc", "--no-shell", "--gres=gpu:1", "--job-name=leftover", "--time=5")
        job = c.jobs()[0]["id"]
        step = subprocess.Popen(["srun", f"--jobid={job}", "--overlap", "sleep", "600"], env={**os.environ, **c.env},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: "sleep" in c.run("squeue", "--steps", "--noheader", "--format=%j"), what="the step")
        root, pids = c.root, [p.pid for p in c.procs.values()]
    assert step.wait(T) is not None
    assert not c.leftovers() and not any(waiting.process_alive(p) for p in pids)
    assert not root.exists()

"""Multi-node on Ray: a REAL local Ray cluster (two loopback nodes with declared GPUs) as the
broker's inventory and placement layer, and a REAL broker process with ``--inventory=ray``.

Ray's own view of the cluster (placement groups, available resources) is checked from this
test process, which is a driver of the same cluster.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waiting
from broker_process import BrokerProcess
from kernels import Reply
from ray_cluster import HEAD, SECOND, LocalRayCluster, ray_missing
from remote_fixtures import kernel_of, ray_broker, ray_env, release_all

from jupyter_gpulease.client import BrokerClient, BrokerError

pytestmark = [
    pytest.mark.skipif(bool(ray_missing()), reason=ray_missing() or "ray installed"),
    pytest.mark.timeout(600),
]

T = 60.0  # generous: on a busy 2-core machine an actor may take seconds to start


wait_for = functools.partial(waiting.wait_for, timeout=T, interval=0.1)


@pytest.fixture(scope="module")
def cluster(ray_cluster: LocalRayCluster) -> LocalRayCluster:
    return ray_cluster  # the session's cluster (tests/conftest.py), shared with the inventory contract


def start_broker(cluster: LocalRayCluster, workdir: Path, *args: str) -> BrokerProcess:
    return ray_broker(cluster, workdir, *args, timeout=T)


@pytest.fixture(scope="module")
def broker(cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    # the default deadline (60 s): a loaded machine may take seconds to place a group
    b = start_broker(cluster, tmp_path_factory.mktemp("ray-broker"))
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[BrokerClient]:
    c = broker.client(timeout=T)
    yield c
    release_all(c)  # leave nothing held for the next test
    wait_for(lambda: not _broker_groups(), what="the broker's placement groups to be removed")
    c.close()


def _groups() -> dict[str, dict[str, Any]]:
    import ray

    return {
        info["name"]: info
        for info in ray.util.placement_group_table().values()
        if info["name"].startswith("gpulease-") and info["state"] != "REMOVED"
    }


def _broker_groups() -> dict[str, dict[str, Any]]:
    return _groups()


def _ready(c: BrokerClient, lease: dict[str, Any]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        view = c.lease(lease["id"])
        return view if (view.get("placement") or {}).get("state") == "ready" else None

    return wait_for(check, what=f"placement group of {lease['id']} ready")


def _gpus_free_in_ray() -> float:
    import ray

    return float(ray.available_resources().get("GPU", 0.0))


# ------------------------------------------------------------------------------ inventory
def test_inventory_is_the_ray_cluster(client: BrokerClient) -> None:
    ids = [g["id"] for g in client.gpus()["gpus"]]
    assert ids == [f"ray:{HEAD}:{i}" for i in range(4)] + [f"ray:{SECOND}:{i}" for i in range(2)]
    info = client.info()
    assert info["simulated"] is False
    inv = info["inventory"]
    assert inv["kind"] == "ray" and inv["simulated"] is False and inv["declared_gpus"] is True
    assert inv["nodes"] == 2 and inv["namespace"]


def test_each_lease_is_a_placement_group_on_distinct_devices(client: BrokerClient) -> None:
    a = client.request_lease(2, wait=T)
    b = client.request_lease(2, wait=T)
    assert a["state"] == b["state"] == "granted"
    assert not set(d["id"] for d in a["devices"]) & set(d["id"] for d in b["devices"])
    a, b = _ready(client, a), _ready(client, b)
    for lease in (a, b):
        p = lease["placement"]
        assert p["kind"] == "ray" and p["placement_group"] == "gpulease-" + lease["id"]
        assert [{k: b[k] for k in ("index", "node", "gpus")} for b in p["bundles"]] == [
            {"index": 0, "node": lease["node"], "gpus": 2}]
        group = _groups()[p["placement_group"]]
        assert group["state"] == "CREATED" and group["strategy"] == "STRICT_PACK"
        assert group["bundles"][0]["GPU"] == 2.0
        assert group["bundles"][0][f"node:{lease['node']}"] > 0
    assert _gpus_free_in_ray() == 2.0
    client.release(a["id"])
    wait_for(lambda: "gpulease-" + a["id"] not in _groups(), what="the released lease's group to be removed")
    assert client.lease(a["id"])["placement"] is None
    wait_for(lambda: _gpus_free_in_ray() == 4.0, what="Ray to free the released GPUs")


def test_gang_that_fits_only_across_nodes(client: BrokerClient) -> None:
    lease = _ready(client, client.request_lease(6, wait=T, locality="any"))
    assert {d["node"] for d in lease["devices"]} == {HEAD, SECOND}
    group = _groups()["gpulease-" + lease["id"]]
    assert group["strategy"] == "PACK"
    assert sorted(b["GPU"] for b in group["bundles"].values()) == [2.0, 4.0]
    assert len(set(group["bundles_to_node_id"].values())) == 2
    assert _gpus_free_in_ray() == 0.0


def _ids_ray_assigned(group_hex: str, bundle: int, gpus: float) -> str:
    """What a task holding bundle ``bundle``'s GPUs in the group sees (Ray's own PlacementGroupSchedulingStrategy)."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = PlacementGroup(PlacementGroupID(bytes.fromhex(group_hex)))
    task = ray.remote(num_cpus=0, num_gpus=gpus)(lambda: ",".join(str(i) for i in ray.get_gpu_ids()))
    return str(ray.get(task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=bundle)).remote(), timeout=T))


def _with_ids(c: BrokerClient, lease: dict[str, Any]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        view = c.lease(lease["id"])
        bundles = (view.get("placement") or {}).get("bundles") or []
        return view if bundles and all("gpu_ids" in b for b in bundles) else None

    return wait_for(check, what=f"the GPU IDs of {lease['id']}'s bundles in its view")


def test_ready_placement_carries_each_bundles_gpu_ids_as_ray_assigned(client: BrokerClient) -> None:
    """The broker learns which GPU IDs Ray assigned to each bundle once the group is placed, and the view shows
    them: what a task in that bundle sees (a kernel then need not ask)."""
    held = _ready(client, client.request_lease(1, wait=T, locality="node"))  # so that the gang's IDs are not 0..n
    gang = _with_ids(client, _ready(client, client.request_lease(5, wait=T, locality="any")))
    bundles = gang["placement"]["bundles"]
    assert {b["node"] for b in bundles} == {HEAD, SECOND}
    for b in bundles:
        seen = _ids_ray_assigned(gang["placement"]["placement_group_id"], b["index"], b["gpus"])
        assert b["gpu_ids"] == seen
        assert len(b["gpu_ids"].split(",")) == b["gpus"]
    held = _with_ids(client, held)
    (one,) = held["placement"]["bundles"]
    assert one["gpu_ids"] == _ids_ray_assigned(held["placement"]["placement_group_id"], 0, 1)
    client.release(gang["id"])
    client.release(held["id"])


def test_gang_that_fits_nowhere_waits_and_holds_nothing(client: BrokerClient) -> None:
    # 2 GPUs (best fit: the 2-GPU node) and 1 (the 4-GPU node) held: 3 free, but no node has 4 free
    held = [_ready(client, client.request_lease(n, wait=T)) for n in (2, 1)]
    lease = client.request_lease(4, wait=2, locality="node")
    assert lease["state"] == "queued" and lease["placement"] is None
    assert set(_groups()) == {"gpulease-" + h["id"] for h in held}  # nothing placed for the waiting gang
    assert _gpus_free_in_ray() == 3.0
    for n, locality in ((5, "node"), (7, "any")):  # never grantable: refused at once, naming why
        with pytest.raises(BrokerError) as e:
            client.request_lease(n, wait=0, locality=locality)
        assert e.value.status == 400 and "can never be granted" in str(e.value)
    client.release(lease["id"])
    assert client.lease(lease["id"])["state"] == "cancelled"
    for h in held:
        client.release(h["id"])
    wait_for(lambda: _gpus_free_in_ray() == 6.0, what="Ray to get the GPUs back")


def test_fractional_leases_pack_onto_shared_gpus(client: BrokerClient) -> None:
    leases = [_ready(client, client.request_lease(0.5, wait=T)) for _ in range(4)]
    devices = [lease["devices"][0]["id"] for lease in leases]
    assert len(set(devices)) == 2  # two halves per GPU
    for lease in leases:
        group = _groups()["gpulease-" + lease["id"]]
        assert group["bundles"][0]["GPU"] == 0.5
    assert _gpus_free_in_ray() == 4.0


def test_placement_that_ray_cannot_make_fails_at_its_deadline(cluster: LocalRayCluster, client: BrokerClient,
                                                              tmp_path: Path) -> None:
    import ray

    @ray.remote(num_cpus=0, num_gpus=2, resources={f"node:{SECOND}": 0.001})
    class Squatter:  # GPUs used outside the broker: the broker believes node 2 is free
        def node(self) -> str:
            return ray.util.get_node_ip_address()

    squatter = Squatter.remote()
    # a broker of its own with a short deadline (in its own namespace, on the same cluster)
    short = start_broker(cluster, tmp_path / "b", "--RayInventory.placement_timeout=2",
                         "--RayInventory.namespace=gpulease-deadline")
    c = short.client(timeout=T)
    try:
        assert ray.get(squatter.node.remote(), timeout=T) == SECOND
        big = c.request_lease(4, wait=T)
        assert big["node"] == HEAD
        lease = c.request_lease(2, wait=T)
        assert lease["state"] == "granted" and lease["node"] == SECOND
        t0 = time.monotonic()
        ended = wait_for(lambda: (v := c.lease(lease["id"]))["state"] == "failed" and v, what="lease to fail")
        assert ended["reason"] == "placement_timeout"
        assert time.monotonic() - t0 < 2 + 10
        assert "gpulease-" + lease["id"] not in _groups()
        assert _ready(c, big)["placement"]["state"] == "ready"  # the other lease is unaffected
        c.release(big["id"])
    finally:
        c.close()
        short.stop()
        ray.kill(squatter)


# ------------------------------------------------------------------------------ %%gpu as a Ray actor
@pytest.fixture(scope="module")
def kernel(cluster: LocalRayCluster, broker: BrokerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # the artifact root is the path both "nodes" share; the kernel joins the cluster as a driver on the head
    with kernel_of(broker, tmp_path_factory.mktemp("ray-artifacts"), ray_env(cluster)) as k:
        yield k


def _hold_head(client: BrokerClient) -> dict[str, Any]:
    """Hold the head's 4 GPUs, so that the next 2-GPU lease lands on the second node."""
    lease = _ready(client, client.request_lease(4, wait=T))
    assert lease["node"] == HEAD
    return lease


def test_gpu_cell_runs_as_a_ray_actor_on_the_gpu_node_with_live_output(
    kernel: Any, client: BrokerClient, tmp_path: Path
) -> None:
    _hold_head(client)
    go = tmp_path / "go"
    code = (
        "%%gpu 2 --out where\n"
        "import os, socket, time\n"
        "print('started', flush=True)\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.05)\n"
        "where = {k: os.environ.get(k) for k in ('GPULEASE_NODE_IP', 'CUDA_VISIBLE_DEVICES', 'GPULEASE_LEASE_ID')}\n"
        "where['pid'], where['hostname'] = os.getpid(), socket.gethostname()\n"
        "print('done', flush=True)\n"
    )
    msg_id = kernel.submit(code)
    # live: the first line arrives while the cell still waits for us
    partial = kernel.collect(msg_id, timeout=T * 2, until=lambda outs: any(
        "started" in o["content"].get("text", "") for o in outs))
    assert partial.status == "partial", (partial.outputs, partial.reply)
    lease = next(v for v in client.leases() if v["state"] in ("granted", "active", "idle") and v["node"] == SECOND)
    assert lease["placement"]["kind"] == "ray"
    go.touch()
    r = kernel.collect(msg_id, timeout=T * 2)
    assert r.status == "ok", (r.outputs, r.reply)
    assert "done" in r.stdout
    where = kernel.run("where").result
    assert where is not None
    where_d = eval(where)  # a dict repr of plain values
    assert where_d["GPULEASE_NODE_IP"] == SECOND
    assert where_d["GPULEASE_LEASE_ID"] == lease["id"]
    assert where_d["hostname"] == os.uname().nodename
    assert sorted(where_d["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]  # as Ray assigned on that node
    ended = wait_for(lambda: (v := client.lease(lease["id"]))["state"] == "released" and v, what="lease released")
    assert ended["placement"] is None


def test_session_keeps_its_ray_worker_across_cells(kernel: Any, client: BrokerClient) -> None:
    r1 = kernel.run("%%gpu 1 --session ray\nimport os\nmodel = [1, 2, 3]\nprint(os.getpid(), os.environ['GPULEASE_NODE_IP'])",
                    timeout=T * 2)
    assert r1.status == "ok", (r1.outputs, r1.reply)
    r2 = kernel.run("%%gpu --session ray\nmodel.append(4)\nprint(os.getpid(), model)", timeout=T)
    assert r2.status == "ok", (r2.outputs, r2.reply)
    pid, node = r1.stdout.split()[:2]
    assert node in (HEAD, SECOND) and r2.stdout.split()[0] == pid and "[1, 2, 3, 4]" in r2.stdout
    lease = next(v for v in client.leases() if v["state"] in ("granted", "active", "idle"))
    assert lease["placement"]["kind"] == "ray"
    kernel.run("%gpu session stop ray")
    wait_for(lambda: not waiting.process_alive(int(pid)), what="the session's worker to be stopped")
    wait_for(lambda: client.lease(lease["id"])["state"] == "released", what="the session's lease released")


def test_revoke_kills_the_ray_worker(kernel: Any, client: BrokerClient, tmp_path: Path) -> None:
    _hold_head(client)
    code = (
        "%%gpu 2\n"
        "import os, subprocess, time\n"
        "child = subprocess.Popen(['sleep', '600'])\n"
        "print('pids', os.getpid(), child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    msg_id = kernel.submit(code)
    partial = kernel.collect(msg_id, timeout=T * 2, until=lambda outs: any(
        "pids" in o["content"].get("text", "") for o in outs))
    line = next(o["content"]["text"] for o in partial.outputs if "pids" in o["content"].get("text", ""))
    pids = [int(p) for p in line.split()[1:3]]
    lease = next(v for v in client.leases() if v["state"] in ("granted", "active", "idle") and v["node"] == SECOND)
    client.revoke(lease["id"], "test")
    r = kernel.collect(msg_id, timeout=T * 2)
    assert r.status == "error", (r.outputs, r.reply)
    assert r.error is not None and "WorkerCrashed" in r.error["ename"] + str(r.error.get("evalue"))
    wait_for(lambda: not any(waiting.process_alive(p) for p in pids), what="the worker and its child to be killed")
    assert client.lease(lease["id"])["reason"].startswith("admin")
    assert "gpulease-" + lease["id"] not in _groups()
    wait_for(lambda: _gpus_free_in_ray() == 2.0, what="Ray to free the revoked lease's GPUs")



# ------------------------------------------------------------------------------ restart and node death
def test_broker_restart_finds_its_groups_and_the_cells_workers_again(
    kernel: Any, broker: BrokerProcess, client: BrokerClient, tmp_path: Path
) -> None:
    """kill -9 the broker while a %%gpu cell runs on a Ray lease: the lease's detached, named group lives on,
    the cell's named worker actor too; the restarted broker finds both again and the cell finishes."""
    import ray

    go = tmp_path / "go"
    code = (
        "%%gpu 2\n"
        "import os, time\n"
        "print('started', os.environ['GPULEASE_RAY_PLACEMENT_GROUP_ID'], flush=True)\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.05)\n"
        "print('done', flush=True)\n"
    )
    msg_id = kernel.submit(code)
    # the whole first line of the cell's stdout (stderr may carry Ray's own words: the kernel joins it meanwhile)
    partial = kernel.collect(msg_id, timeout=T * 2, until=lambda outs: "\n" in Reply("partial", outs).stdout)
    assert partial.status == "partial", (partial.outputs, partial.reply)
    lease = next(v for v in client.leases() if v["state"] in ("granted", "active", "idle"))
    group = lease["placement"]["placement_group_id"]
    assert group in partial.stdout  # the cell knows its group (to use the rest of a gang through Ray)
    namespace = lease["placement"]["namespace"]
    # the cell's worker: lent by the node's warm host (outside the group, shared by the kernels: RayExecutor.warm)
    # (one per interpreter and PYTHON* settings: a kernel of another test module may have started another)
    workers = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if a["namespace"] == namespace and a["name"].startswith(f"gpulease-host-{lease['node']}-")]
    assert workers, ray.util.list_named_actors(all_namespaces=True)

    broker.kill9()  # no cleanup code runs
    assert "gpulease-" + lease["id"] in _groups()
    broker.start(timeout=T)
    client.close()
    again = _ready(client, client.lease(lease["id"]))
    assert again["state"] in ("granted", "active", "idle")
    assert again["placement"]["placement_group_id"] == group
    assert f"placement group gpulease-{lease['id']} found again" in broker.log_path.read_text(errors="replace")
    assert all(ray.get_actor(w["name"], namespace=namespace) for w in workers)  # still alive

    go.touch()
    r = kernel.collect(msg_id, timeout=T * 2)
    assert r.status == "ok", (r.outputs, r.reply)
    assert "done" in r.stdout
    wait_for(lambda: client.lease(lease["id"])["state"] == "released", what="the lease released by the kernel")
    wait_for(lambda: "gpulease-" + lease["id"] not in _groups(), what="the group removed at release")


@pytest.mark.slow
def test_node_death_fails_its_leases_and_its_gpus_leave(cluster: LocalRayCluster, client: BrokerClient) -> None:
    _hold_head(client)
    lease = _ready(client, client.request_lease(2, wait=T))
    assert lease["node"] == SECOND
    cluster.remove_node(SECOND)
    try:
        ended = wait_for(lambda: (v := client.lease(lease["id"]))["state"] == "failed" and v, what="the lease to fail")
        assert ended["reason"] == f"node_lost: {SECOND}"
        ids = [g["id"] for g in client.gpus()["gpus"]]
        assert ids == [f"ray:{HEAD}:{i}" for i in range(4)]
        wait_for(lambda: "gpulease-" + lease["id"] not in _groups(), what="its placement group removed")
    finally:
        cluster.add_node(SECOND, gpus=2)
        cluster.cluster.wait_for_nodes()
    wait_for(lambda: len(client.gpus()["gpus"]) == 6, what="the node's GPUs to come back")

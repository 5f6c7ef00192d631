"""Warm Ray cells: a kernel's single-use ``%%gpu`` cells borrow a pre-started worker from the node's warm host
(``executors.ray.WarmHost``: a detached actor outside the leases' placement groups that every kernel shares) instead
of starting an actor per cell.
A REAL local Ray cluster (tests/ray_cluster.py), a REAL broker with ``--inventory=ray`` and REAL kernels.

Revocation of a warm cell: tests/broker/inventory/test_ray.py::test_revoke_kills_the_ray_worker (the cells there
are warm too); here, that the warm host outlives it and lends the next cell a new worker.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import pytest
import waiting
from broker_process import BrokerProcess
from ray_cluster import HEAD, SECOND, LocalRayCluster, ray_missing
from remote_fixtures import kernel_of, placed, ray_cell_fixtures, ray_env

from jupyter_gpulease.client import BrokerClient

pytestmark = [
    pytest.mark.skipif(bool(ray_missing()), reason=ray_missing() or "ray installed"),
    pytest.mark.timeout(600),
]

T = 60.0  # generous: on a busy 2-core machine an actor may take seconds to start

wait_for = functools.partial(waiting.wait_for, timeout=T, interval=0.05)

#: a cell that says where it ran: its pid, its parent's (the actor's process), its start time, its GPUs
WHERE = ("import os, time\n"
         "_ticks = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])\n"
         "_btime = next(int(x.split()[1]) for x in open('/proc/stat') if x.startswith('btime'))\n"
         "boot = _btime + _ticks / os.sysconf('SC_CLK_TCK')\n"
         "print('where', os.getpid(), os.getppid(), os.environ['CUDA_VISIBLE_DEVICES'] or '-',"
         " os.environ['GPULEASE_RAY_PLACEMENT_GROUP_ID'], os.environ['GPULEASE_NODE_IP'], flush=True)\n")


broker, client, kernel = ray_cell_fixtures("ray-warm", timeout=T)


def _where(r: Any) -> dict[str, Any]:
    assert r.status == "ok", (r.outputs, r.reply)
    line = next(x for x in r.stdout.splitlines() if x.startswith("where "))
    pid, ppid, visible, group, node = line.split()[1:6]
    return {"pid": int(pid), "actor_pid": int(ppid), "visible": "" if visible == "-" else visible, "group": group,
            "node": node}


def _gpu_ids_of(group_hex: str, gpus: float) -> list[str]:
    """The GPU IDs Ray assigned in a lease's group, asked as the kernel asks (a task in the group)."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    from gpulease_protocol.ray_ids import gpu_ids, in_bundle

    pg = PlacementGroup(PlacementGroupID(bytes.fromhex(group_hex)))
    return str(ray.get(in_bundle(ray.remote(num_cpus=0)(gpu_ids), pg, 0, gpus).remote(), timeout=T)).split(",")


def test_ray_warm_lease_ended_while_a_task_runs_in_its_group_leaves_the_node_alive(
    client: BrokerClient, tmp_path: Path
) -> None:
    """The kernel asks a lease's group for its GPU IDs with a task in the group (``in_bundle``); a lease revoked while
    such a task runs stops the task, and the node's raylet lives on (asked by the group's resource names instead,
    Ray 2.60's raylet aborted and the node died)."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    from gpulease_protocol.ray_ids import in_bundle

    def slow_gpu_ids(started: str, seconds: float) -> str:  # by value: Ray's workers cannot import this module
        import pathlib
        import time

        from gpulease_protocol.ray_ids import gpu_ids

        pathlib.Path(started).touch()
        time.sleep(seconds)
        return gpu_ids()

    lease = placed(client, client.request_lease(1, wait=T), T)
    group = lease["placement"]["placement_group_id"]
    pg = PlacementGroup(PlacementGroupID(bytes.fromhex(group)))
    started = tmp_path / "started"
    task = in_bundle(ray.remote(num_cpus=0)(slow_gpu_ids), pg, 0, 1).remote(str(started), 30)
    wait_for(started.exists, what="the task in the group to run")
    ip = lease["placement"]["bundles"][0]["node"]
    (node,) = (n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip)  # (test_ray.py
    client.revoke(lease["id"], "test")                          # removes a node and adds one at its address again)
    with pytest.raises(Exception):  # noqa: B017 (Ray's error for a task of a removed group varies by cause)
        ray.get(task, timeout=T)
    waiting.holds_for(lambda: any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node), seconds=3,
                      what=f"node {ip} alive (Ray marks a dead raylet's node dead within 2 s here)")


def _own_gpu_id_task(k: Any) -> bool:
    """Whether the kernel ran a GPU-ID task of its own (a Ray worker process of its job on the node)."""
    r = k.run("get_ipython().magics_manager.registry['GpuMagics'].executors['ray']._warm._gpu_ids is not None")
    assert r.status == "ok", r.outputs
    return r.result == "True"


def test_ray_warm_first_cell_of_each_new_kernel_borrows_the_nodes_shared_host(
    ray_cluster: LocalRayCluster, broker: BrokerProcess, client: BrokerClient, tmp_path: Path
) -> None:
    """A new kernel's first cell on a node borrows a worker of the node's warm host, which the first kernel there
    started and every later kernel finds by name, with the GPU IDs of the lease view (the broker's): the kernel starts
    no Ray worker process of its own job (neither an actor nor a GPU-ID task); the next cell borrows the next worker."""
    seen: dict[str, int] = {}  # node -> its host's pid
    for n in range(2):
        with kernel_of(broker, tmp_path / f"artifacts{n}", ray_env(ray_cluster)) as k:
            first = _where(k.run(f"%%gpu 1\n{WHERE}", timeout=T * 2))
            second = _where(k.run(f"%%gpu 1\n{WHERE}", timeout=T * 2))
            assert not _own_gpu_id_task(k)
        assert second["actor_pid"] == first["actor_pid"]  # both lent by the node's host
        assert second["pid"] != first["pid"]
        assert seen.setdefault(first["node"], first["actor_pid"]) == first["actor_pid"]  # the same host for both kernels
        assert waiting.process_alive(first["actor_pid"])  # it outlives the kernel that started it


def test_ray_warm_second_cell_borrows_the_prestarted_worker(kernel: Any, client: BrokerClient) -> None:
    first = _where(kernel.run(f"%%gpu 1\n{WHERE}", timeout=T * 2))
    submitted = time.time()
    t0 = time.monotonic()
    r = kernel.run(f"%%gpu 1\n{WHERE}print('boot', boot)\n", timeout=T)
    took = time.monotonic() - t0
    second = _where(r)
    boot = float(next(x for x in r.stdout.splitlines() if x.startswith("boot ")).split()[1])
    assert second["actor_pid"] == first["actor_pid"]  # the same warm actor on the node
    assert second["pid"] != first["pid"]  # a fresh worker: single-use, never a used one
    assert boot < submitted + 0.02  # started before the cell was asked for (clock ticks: 10 ms): pre-started
    assert took < 20, took  # no actor start (a bound for a loaded 2-core machine; the figure is in BENCHMARKS.md)
    assert not waiting.process_alive(first["pid"])


def test_ray_warm_cell_on_other_gpus_sees_the_ids_ray_assigned_to_its_group(kernel: Any, client: BrokerClient) -> None:
    second = placed(client, client.request_lease(2, wait=T), T)  # the second node held: the cells go to the head
    assert second["node"] == SECOND
    before = _where(kernel.run(f"%%gpu 2\n{WHERE}", timeout=T * 2))
    assert before["node"] == HEAD
    head = placed(client, client.request_lease(2, wait=T), T)  # two of the head's GPUs held: the cell gets the others
    assert head["node"] == HEAD
    held = _gpu_ids_of(head["placement"]["placement_group_id"], 2)
    cell = _where(kernel.run(f"%%gpu 2\n{WHERE}", timeout=T * 2))
    assert cell["actor_pid"] == before["actor_pid"]  # the same warm actor, lent to a cell of another lease
    assert cell["group"] != before["group"]
    ids = cell["visible"].split(",")
    assert len(ids) == 2 and not set(ids) & set(held), (ids, held)
    client.release(head["id"])
    client.release(second["id"])


def test_ray_warm_actor_outlives_a_revoked_cell_and_lends_the_next_a_new_worker(
    kernel: Any, client: BrokerClient
) -> None:
    before = _where(kernel.run(f"%%gpu 1\n{WHERE}", timeout=T * 2))
    msg_id = kernel.submit(f"%%gpu 1\n{WHERE}time.sleep(600)\n")
    partial = kernel.collect(msg_id, timeout=T * 2, until=lambda outs: any(
        "where" in o["content"].get("text", "") for o in outs))
    line = next(o["content"]["text"] for o in partial.outputs if "where" in o["content"].get("text", ""))
    pid = int(line.split()[1])
    lease = next(v for v in client.leases() if v["phase"] != "ended")
    t0 = time.monotonic()
    client.revoke(lease["id"], "test")
    wait_for(lambda: not waiting.process_alive(pid), what="the revoked cell's worker to be stopped")
    assert time.monotonic() - t0 < 10
    r = kernel.collect(msg_id, timeout=T)
    assert r.status == "error", (r.outputs, r.reply)
    after = _where(kernel.run(f"%%gpu 1\n{WHERE}", timeout=T * 2))
    if after["node"] == before["node"]:
        assert after["actor_pid"] == before["actor_pid"]  # the warm actor lives on
    assert after["pid"] not in (pid, before["pid"])


def test_ray_warm_host_outlives_a_killed_kernel_whose_lent_worker_stops_with_its_lease(
        ray_cluster: LocalRayCluster, broker: BrokerProcess, kernel: Any, client: BrokerClient, tmp_path: Path) -> None:
    """A kernel killed while its cell runs in a worker lent by the node's host: the broker ends the kernel's lease, and
    the host kills the worker once the lease's group is removed; the host lives on and lends the next kernel's cell a
    worker."""
    with kernel_of(broker, tmp_path / "artifacts", ray_env(ray_cluster)) as k:
        msg_id = k.submit(f"%%gpu 1\n{WHERE}time.sleep(600)\n")
        partial = k.collect(msg_id, timeout=T * 2, until=lambda outs: any(
            "where" in o["content"].get("text", "") for o in outs))
        line = next(o["content"]["text"] for o in partial.outputs if "where" in o["content"].get("text", ""))
        pid, host, node = int(line.split()[1]), int(line.split()[2]), line.split()[5]
        k.kill9()
        wait_for(lambda: not waiting.process_alive(pid), what="the dead kernel's cell stopped with its lease")
    assert waiting.process_alive(host)
    after = _where(kernel.run(f"%%gpu 1\n{WHERE}", timeout=T * 2))
    if after["node"] == node:
        assert after["actor_pid"] == host

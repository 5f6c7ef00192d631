"""Which GPU IDs Ray assigned to a bundle of a lease's placement group: one task, one definition for both halves.

The broker (``lease_broker.inventory.ray``) runs it once per bundle when the lease's group is placed and shows the
answer in the lease view (``placement.bundles[i].gpu_ids``); the kernel (``jupyter_gpulease.executors.ray``) runs it
itself only where the view does not carry them (an older broker, or not known yet). The broker asks for the bundle's
GPUs by the group's resource names (``group_resources``) with ``num_gpus=0``: Ray then runs the task in an idle CPU
worker process of its job on the node (one asked with ``num_gpus`` gets a new worker process, 2-3 s of Python and
``import ray``), and still gives it the group's GPU IDs; it removes a group only once its tasks there ended (Ray
2.60's raylet aborts otherwise). The kernel's own task asks with ``PlacementGroupSchedulingStrategy``, which Ray
ends with the group.

Imports nothing beyond the standard library; ``ray`` only inside the task, on the node.
"""

from __future__ import annotations


def gpu_ids() -> str:
    """(A Ray task in a lease's group, on the GPU node.) The GPU IDs Ray assigned there, as CUDA_VISIBLE_DEVICES."""
    import ray

    return ",".join(str(i) for i in ray.get_gpu_ids())


def group_resources(bundle: int, placement_group_id: str, gpus: float) -> dict[str, float]:
    """The resources that hold bundle ``bundle``'s ``gpus`` GPUs of the group ``placement_group_id`` (hex), as Ray
    names a placement group's resources (what ``PlacementGroupSchedulingStrategy`` with ``num_gpus`` asks for)."""
    return {f"GPU_group_{bundle}_{placement_group_id}": gpus, f"GPU_group_{placement_group_id}": gpus}

"""Which GPU IDs Ray assigned to a bundle of a lease's placement group: one task, one way to place it, for both
halves.

The broker (``lease_broker.inventory.ray``) runs it once per bundle when the lease's group is placed and shows the
answer in the lease view (``placement.bundles[i].gpu_ids``); the kernel (``jupyter_gpulease.executors.ray``) runs it
itself only where the view does not carry them (an older broker, or the broker has not learned them yet). Both place
it as Ray places tasks in a group (``in_bundle``), never by the group's resource names (``GPU_group_0_<id>``), which
Ray does not tie to the bundle: Ray 2.60's raylet aborts (the node dies) when a group is removed while a task asked
that way runs; asked this way, a lease that ends meanwhile stops the task, as any task in its group
(tests/broker/inventory/test_ray_warm.py). Ray runs it in an idle worker process of the asking job on the node when
there is one (milliseconds), else starts one (a new Python's ``import ray``: seconds).

Imports nothing beyond the standard library; ``ray`` only inside the functions, where Ray is installed.
"""

from __future__ import annotations

from typing import Any


def gpu_ids() -> str:
    """(A Ray task in a lease's group, on the GPU node.) The GPU IDs Ray assigned there, as CUDA_VISIBLE_DEVICES."""
    import ray

    return ",".join(str(i) for i in ray.get_gpu_ids())


def in_bundle(task: Any, pg: Any, bundle: int, gpus: float) -> Any:
    """``task`` (a Ray remote function) asked to run in bundle ``bundle`` of the lease's group ``pg`` with its
    ``gpus``, run once (no retries: a group removed meanwhile ends it)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return task.options(num_gpus=gpus, max_retries=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))

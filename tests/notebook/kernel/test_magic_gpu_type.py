"""`%%gpu --gpu-type/--gpu-mem` in a real kernel against a real broker with a mixed simulated inventory."""

from __future__ import annotations

from pathlib import Path

from kernels import Kernel


def test_a_cell_runs_on_the_type_it_asked_for(broker_factory, tmp_path: Path) -> None:
    broker = broker_factory(args=["--tick=0.1", "--SimulatedInventory.cluster=1x2:A100-40GB,1x1:H100:80G"])
    h100 = next(g["id"] for g in broker.client().gpus()["gpus"] if g["name"] == "H100")
    k = Kernel(broker.url, str(tmp_path / "art"))
    try:
        r = k.run("%%gpu 1 --gpu-type H100\nimport os\nprint(os.environ['CUDA_VISIBLE_DEVICES'])")
        assert r.status == "ok", r.outputs
        assert h100 in r.stdout
        r = k.run("%%gpu 1 --gpu-mem 64G\nimport os\nprint(os.environ['CUDA_VISIBLE_DEVICES'])")
        assert r.status == "ok" and h100 in r.stdout, r.outputs  # only the H100 has 64G
        r = k.run("%%gpu 2 --gpu-type V100\npass")
        assert r.error is not None and r.error["ename"] == "UsageError"
        assert "1x H100 (80G)" in r.error["evalue"] and "2x A100-40GB (40G)" in r.error["evalue"], r.error
        r = k.run("%%gpu 1 --gpu-mem -4G\npass")
        assert r.error is not None and "Invalid --gpu-mem '-4G'" in r.error["evalue"], r.error
    finally:
        k.stop()

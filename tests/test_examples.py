"""The example notebooks run top to bottom through nbclient, in real kernels, against a real broker."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["quickstart", "hyperparameter_search", "sessions"])
def test_example_notebook_runs(name: str, broker_factory, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    b = broker_factory(gpus=4, args=["--tick=0.1"], name=name)
    monkeypatch.setenv("GPULEASE_BROKER", b.url)
    monkeypatch.setenv("GPULEASE_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(
        o.get("text", "") if o.get("output_type") == "stream" else str(o.get("data", {}).get("text/plain", ""))
        for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    )
    if name != "hyperparameter_search":
        assert "gpulease: lease " in text  # %%gpu cells report their lease
    if name == "quickstart":
        assert "step 150" in text and "weights.npy" in text and "ok Simulated GPU" in text
        assert "max |w - true_w| =" in text
    elif name == "hyperparameter_search":
        assert "best lr:" in text and text.count("lr=") >= 6
    else:
        assert "same worker" in text and "score in the kernel" in text and "stopped" in text
        assert "parked" in text and "4 variables" in text and "same model (256, 256)" in text
    assert [x for x in b.client().leases() if not x["ended_at"]] == []  # nothing left holding a GPU


@pytest.mark.parametrize("name", ["interactive-first"])
def test_example_policy_loads_for_the_broker_and_the_replay(name: str) -> None:
    """Each policy in examples/policies loads as the broker and ``gpulease replay --config`` load it, and every
    option it sets is an option of the policy (traitlets only warns about a misspelt one)."""
    from traitlets.config.loader import PyFileConfigLoader

    from lease_broker.policy.lease_policy import LeasePolicy
    from lease_broker.replay.policy import load_policy

    path = EXAMPLES / "policies" / f"{name}.py"
    cfg = PyFileConfigLoader(path.name, path=str(path.parent)).load_config()
    assert set(cfg) == {"LeasePolicy"}
    assert set(cfg.LeasePolicy) <= set(LeasePolicy.class_trait_names(config=True))
    policy = load_policy(str(path))
    for key, value in cfg.LeasePolicy.items():
        assert getattr(policy, key) == value, key
    if name == "interactive-first":
        assert policy.preempt_mode == "suspend" and policy.suspend_max_gpus == 1
        assert 0 <= policy.suspend_max_share < 1 and policy.suspend_min_runtime_seconds > 0

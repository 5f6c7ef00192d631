"""`make demo`'s script, end to end: a broker with simulated GPUs, JupyterLab with both extensions."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_demo_script_starts_broker_and_lab_with_the_extensions(tmp_path: Path) -> None:
    env = {**os.environ, "DEMO_CHECK": "1", "DEMO_PORT": str(_free_port()), "DEMO_GPUS": "3"}
    env.pop("GPULEASE_BROKER", None)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), str(tmp_path / "demo")], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(SIMULATED inventory): 3/3 GPUs free" in out.stdout
    assert "JupyterLab answers" in out.stdout
    assert "sidebar extension: enabled" in out.stdout
    assert "server extension: answers" in out.stdout
    assert sorted(p.name for p in (tmp_path / "demo" / "notebooks").glob("*.ipynb")) == [
        "hyperparameter_search.ipynb", "quickstart.ipynb", "sessions.ipynb"]

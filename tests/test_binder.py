"""The Binder steps (postBuild, then start) in a fresh virtualenv: what mybinder.org would run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_binder_postbuild_and_start_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    if shutil.which("node") is None:
        pytest.fail("Binder builds the sidebar with Node (binder/environment.yml); this machine has no node")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    home = tmp_path / "home"
    (home / "examples").mkdir(parents=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(home), "TMPDIR": str(tmp_path),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("GPULEASE_BROKER", None)
    env.pop("VIRTUAL_ENV", None)
    build = subprocess.run(["bash", str(ROOT / "binder" / "postBuild")], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    ext = subprocess.run([str(venv / "bin" / "jupyter"), "labextension", "list"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert "jupyter-gpulease" in ext.stdout + ext.stderr and "enabled" in ext.stdout + ext.stderr
    try:
        run = subprocess.run(["bash", str(ROOT / "binder" / "start"), "gpulease", "status"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "(SIMULATED inventory): 4/4 GPUs free" in run.stdout
    finally:  # `start` leaves its broker running beside the command it execs, as on Binder
        subprocess.run(["pkill", "-f", f"socket={tmp_path}"], check=False)  # no leading "--": not an option

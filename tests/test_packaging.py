"""The package as a user gets it: built from a clean checkout (the files git tracks, nothing built) and installed
with the ``[lab]`` extra into a fresh virtualenv, by Binder's own steps (postBuild, then start). One build and one
install serve every check, so this costs what the Binder check alone used to."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABEXT = "share/jupyter/labextensions/jupyter-gpulease"


def clean_checkout(dest: Path) -> Path:
    """The files a commit of the working tree would hold (tracked, or new and not ignored): no virtualenv, no
    node_modules, no built sidebar."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():  # a file deleted in the working tree but still in the index is not part of it
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(name))
    return dest


@pytest.mark.slow
def test_clean_checkout_installs_with_jupyterlab_and_both_extensions_enabled(tmp_path: Path) -> None:
    if shutil.which("node") is None:
        pytest.fail("building the sidebar from source needs Node.js (binder/environment.yml); this machine has none")
    src = clean_checkout(tmp_path / "src")
    assert not (src / "jupyter_gpulease" / "labextension").exists() and not (src / "labextension" / "node_modules").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    home = tmp_path / "home"
    (home / "examples").mkdir(parents=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(home), "TMPDIR": str(tmp_path),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "JUPYTER_CONFIG_DIR": str(home / ".jupyter"),
           "GPULEASE_PIP_CACHE": "1"}  # pip's cache, as on this machine: the downloads are not what is tested
    for var in ("GPULEASE_BROKER", "VIRTUAL_ENV", "JUPYTER_PATH", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_PATH"):
        env.pop(var, None)

    # Binder's postBuild: pip install ".[lab]" from the checkout (builds the wheel, the sidebar included)
    build = subprocess.run(["bash", str(src / "binder" / "postBuild")], cwd=src, env=env, capture_output=True,
                           text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]

    def jupyter(*args: str) -> str:
        out = subprocess.run([str(venv / "bin" / "jupyter"), *args], env=env, capture_output=True, text=True,
                             timeout=120)
        return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)  # without the terminal colours

    # the [lab] extra brought JupyterLab, and both extensions are found and enabled in the fresh environment
    assert (venv / "bin" / "jupyter-lab").exists(), "the [lab] extra did not install JupyterLab"
    labext = jupyter("labextension", "list")
    assert "jupyter-gpulease v0.1.0" in labext and "enabled" in labext and "OK" in labext, labext
    serverext = jupyter("server", "extension", "list")
    assert any("jupyter_gpulease" in line and "enabled" in line for line in serverext.splitlines()), serverext
    installed = venv / LABEXT
    assert (installed / "install.json").exists() and not (installed / "build_log.json").exists()

    # the wheel itself (the sidebar built above is reused): no build log, the lab extra declared
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                    str(src)], env=env, check=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("jupyter_gpulease-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert not [n for n in names if n.endswith("build_log.json")], "the wheel ships the frontend build's log"
    assert any(n.endswith(f"{LABEXT}/static/style.js") for n in names)
    assert any(n.endswith("etc/jupyter/jupyter_server_config.d/jupyter_gpulease.json") for n in names)
    assert re.search(r"^Requires-Dist: jupyterlab[^;\n]*; extra == ['\"]lab['\"]$", metadata, re.M), metadata

    # Binder's start: a broker with simulated GPUs beside what it runs
    try:
        run = subprocess.run(["bash", str(src / "binder" / "start"), "gpulease", "status"], cwd=src, env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "SIMULATED" in run.stdout and "4/4 GPUs free" in run.stdout
    finally:  # `start` leaves its broker running beside the command it execs, as on Binder
        subprocess.run(["pkill", "-f", f"socket={tmp_path}"], check=False)  # no leading "--": not an option

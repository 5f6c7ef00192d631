"""The demo's first start: ``make demo`` on a fresh clone, until JupyterLab answers with the extension (DEMO_CHECK=1).

Cold: pip's and yarn's caches empty, so every package comes from the registries, as on a new machine. Baseline
in the same run: a second fresh clone with this machine's caches as they are (the packages already downloaded).
The clone is of the committed HEAD, so uncommitted changes are not measured.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .report import Figure, figure

TITLE = "The demo's first start"
ROOT = Path(__file__).resolve().parent.parent
GOAL = 90.0  # seconds (issue 35)


def _first_start(cold: bool) -> tuple[float, dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="gldemo"))
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(work / "clone")], check=True, timeout=120)
        env = {**os.environ, "DEMO_CHECK": "1", "DEMO_PORT": "8897"}
        env.pop("VIRTUAL_ENV", None)
        if cold:
            env.update(PIP_NO_CACHE_DIR="1", YARN_CACHE_FOLDER=str(work / "yarn"),
                       YARN_GLOBAL_FOLDER=str(work / "yarn-global"), YARN_ENABLE_GLOBAL_CACHE="0")
        t0 = time.monotonic()
        proc = subprocess.run(["make", "demo"], cwd=work / "clone", env=env, capture_output=True, text=True,
                              timeout=900)
        seconds = time.monotonic() - t0
        out = proc.stdout + proc.stderr
        if proc.returncode != 0 or "JupyterLab answers" not in out:
            raise RuntimeError(f"make demo failed ({proc.returncode}):\n{out[-3000:]}")
        venv = work / "clone" / ".venv"
        size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
        extras = [name for name in ("ray", "pytest", "mypy", "ruff")
                  if list((venv / "lib").glob(f"python3*/site-packages/{name}"))]
        return seconds, {"venv_mb": size / 1e6, "extras": extras, "deprecation": "deprecat" in out.lower()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(opts: Any) -> list[Figure]:
    cold, facts = _first_start(cold=True)
    warm, _ = _first_start(cold=False)
    return [figure(
        "make demo on a fresh clone until JupyterLab answers, empty pip and yarn caches", "s", [cold],
        "the same with this machine's caches", [warm], bar=("max", "<=", GOAL),
        note=f"`git clone` of HEAD, then `DEMO_CHECK=1 make demo` (the demo extra only: a {facts['venv_mb']:.0f} MB "
             f"virtualenv; test, dev and Ray packages in it: {', '.join(facts['extras']) or 'none'}; a deprecation "
             f"warning in its output: {'yes' if facts['deprecation'] else 'no'}); cold: PIP_NO_CACHE_DIR and empty "
             "yarn caches, every package from the registries")]

"""The docs say what the code does: generated reference blocks are current, and documented options exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_reference_blocks_are_current() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_documented_magic_option_exists_and_every_option_is_documented() -> None:
    from jupyter_gpulease.kernel.magics import GpuMagics

    usage = GpuMagics.gpu.__doc__ or ""
    real = set(re.findall(r"(--[a-z][a-z-]*)", usage))
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    prose = re.sub(r"<!-- BEGIN GENERATED.*?END GENERATED: [\w-]+ -->", "", guide, flags=re.S)
    used = set(re.findall(r"%%gpu[^\n`]*", prose))
    documented = {opt for line in used for opt in re.findall(r"(--[a-z][a-z-]*)", line)}
    documented |= set(re.findall(r"`(--[a-z][a-z-]*)", prose))
    assert documented - real == set(), f"documented but not implemented: {documented - real}"
    assert real - documented == set(), f"implemented but never explained in the guide: {real - documented}"
    for cmd in ("status", "leases", "queue", "release", "sessions", "artifacts", "jobs"):
        assert f"`%gpu {cmd}" in prose, cmd

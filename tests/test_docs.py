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


def test_chargeback_by_label_runs_as_the_admin_guide_says(broker) -> None:
    """The admin guide's chargeback: a lease labelled over the API (as the guide says, with ``BrokerClient``) is a
    row of ``gpulease admin usage --by label --label project --csv``, under the guide's CSV header; the ways the
    guide names to set a label exist, and the one it once named (``gpulease request --label``) is not claimed."""
    import os

    from jupyter_gpulease.client import BrokerClient

    guide = (ROOT / "docs" / "admin-guide.md").read_text()
    assert 'BrokerClient().request_lease(1, labels={"project": "vision"})' in guide
    assert not re.search(r"gpulease request[^`\n]*--label", guide)
    client = BrokerClient(broker.url)
    lease = client.request_lease(1, labels={"project": "vision"})
    client.release(lease["id"])
    env = {**os.environ, "GPULEASE_BROKER": broker.url}
    out = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "admin", "usage", "--since", "30d",
                          "--by", "label", "--label", "project", "--csv"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    example = guide.split("$ gpulease admin usage --since 30d --by label --label project --csv\n", 1)[1]
    assert example.splitlines()[0] == header
    assert [r.split(",")[0] for r in rows] == ["vision"], out.stdout
    helped = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "request", "--help"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert helped.returncode == 0 and "--label" not in helped.stdout

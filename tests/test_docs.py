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


def _gpulease(args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "GPULEASE_BROKER": url}, timeout=60)


def test_the_readme_broker_tour_runs_as_written(broker) -> None:
    """Every ``gpulease`` line of the README's "broker in 30 seconds" runs against a broker started as it says (4
    simulated GPUs), the release with the id its first request printed; each says what its comment promises."""
    import shlex

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## The broker in 30 seconds", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert "lease-broker --inventory=simulated --gpus=4" in block
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.startswith("gpulease ")]
    assert len(lines) >= 5, block
    first = ""
    for line in lines:
        args = shlex.split(line)[1:]
        if args[0] == "release":
            assert first, "the tour releases before it requests"
            args[1] = first
        out = _gpulease(args, broker.url)
        assert out.returncode == 0, f"{line}: {out.stdout}{out.stderr}"
        if args[0] == "request":
            assert " granted\n" in out.stdout and "idle: revoked after" in out.stdout, out.stdout  # the rules it cites
            first = first or out.stdout.split()[0]
        if args[0] == "quota":
            assert "GPU" in out.stdout, out.stdout
    assert "1 min while someone else's request waits" in readme  # the CLI's pressure rule, as request prints it


def test_the_guide_names_only_commands_and_options_the_cli_has(broker) -> None:
    """The user guide's ``gpulease`` table: each command is one of ``gpulease -h``'s, each request option is one of
    ``gpulease request -h``'s and every one of those is in the table; the wait line's words are the broker's."""
    from lease_broker.core.estimate import wait_words

    guide = (ROOT / "docs" / "user-guide.md").read_text()
    cli = guide.split("## `gpulease` (command line)", 1)[1].split("\n## ", 1)[0]
    top = _gpulease(["--help"], broker.url).stdout
    commands = set(re.findall(r"\{([a-z,]+)\}", top)[0].split(","))
    named = set(re.findall(r"^\| `gpulease ([a-z]+)", cli, flags=re.M))
    assert named and named - commands == set(), named - commands
    row = next(ln for ln in cli.splitlines() if ln.startswith("| `gpulease request"))
    documented = set(re.findall(r"--[a-z][a-z-]*", row))
    real = set(re.findall(r"--[a-z][a-z-]*", _gpulease(["request", "--help"], broker.url).stdout)) - {"--help"}
    assert documented == real, (documented ^ real)
    for words, (low, high) in {"in 1–4 min": (60, 240), "within 6 min": (0, 360), "in about 20 min": (1200, 1200),
                               "in under a minute": (0, 50)}.items():
        assert f"`{words}`" in guide or f"estimated start {words}" in guide, words
        assert wait_words(low, high).text == words
    assert "~" not in re.findall(r"estimated start [^`]*", guide)[0]

"""`make demo`'s script, end to end: a broker with simulated GPUs, JupyterLab with both extensions."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import socket
import subprocess
import termios
import threading
import time
import urllib.request
from pathlib import Path

import pytest

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
    # a second terminal finds this broker: the line to paste, with the socket the broker listens on
    export = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("export GPULEASE_BROKER=")]
    assert len(export) == 1, out.stdout
    url = export[0].split("=", 1)[1]
    assert url.startswith("unix://") and url.endswith("/broker.sock"), url
    assert "JupyterLab answers" in out.stdout
    assert "sidebar extension: enabled" in out.stdout
    assert "server extension: answers" in out.stdout
    assert sorted(p.name for p in (tmp_path / "demo" / "notebooks").glob("*.ipynb")) == [
        "hyperparameter_search.ipynb", "quickstart.ipynb", "sessions.ipynb"]


def _ours(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (the demo's directory): its broker, JupyterLab, their kernels."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(marker.encode() in a for a in argv) and cmdline.parent.name != str(os.getpid()):
            found.append(f"{cmdline.parent.name}: {b' '.join(argv).decode(errors='replace')[:200]}")
    return found


def test_one_ctrl_c_stops_jupyterlab_and_the_broker(tmp_path: Path) -> None:
    """``make demo`` in a terminal (a pseudo-terminal here), then one Ctrl-C typed into it."""
    demo, port, token = tmp_path / "demo", _free_port(), "t" * 32
    env = {**os.environ, "DEMO_PORT": str(port), "DEMO_GPUS": "2", "DEMO_TOKEN": token}
    env.pop("GPULEASE_BROKER", None)
    master, terminal = pty.openpty()
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "demo.sh"), str(demo)], env=env, stdin=terminal,
                            stdout=terminal, stderr=terminal, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # its controlling terminal
    os.close(terminal)
    out = bytearray()
    reader = threading.Thread(target=_drain, args=(master, out), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        assert proc.poll() is None, out.decode(errors="replace")
        assert len(_ours(str(demo))) >= 2, "the broker and JupyterLab run"
        os.write(master, b"\x03")  # Ctrl-C: the terminal signals its foreground process group
        proc.wait(90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(10)
        os.close(master)
    text = out.decode(errors="replace")
    assert _ours(str(demo)) == [], text
    assert not (demo / "broker.sock").exists(), "the broker's socket is left behind"
    assert "Stopped JupyterLab and the broker." in text
    assert "Shut down this Jupyter server" not in text
    # current option names (--IdentityProvider.token); an installed extension's own warning (ipyparallel's, once
    # `make bench` has installed it: "_jupyter_server_extension_points ... was not found") is not the demo's
    ours = [line for line in text.splitlines()
            if "deprecat" in line.lower() and "_jupyter_server_extension_" not in line]
    assert not ours, ours


def _drain(fd: int, into: bytearray) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every process on the terminal has closed it
            return
        if not chunk:
            return
        into.extend(chunk)


def test_example_notebooks_are_in_the_form_jupyter_writes() -> None:
    """JupyterLab rewrites a notebook that is not in nbformat's own form, or whose kernelspec is not the installed
    one's, and shows it modified on open (the kernel's language_info is stamped by ``make_examples.py --copy-to``:
    tests/test_browser.py opens such a copy)."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    for path in sorted((ROOT / "examples").glob("*.ipynb")):
        text = path.read_text()
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
        assert nbformat.writes(nb) + "\n" == text, f"{path.name}: not in canonical nbformat form"
        assert (nb.nbformat, nb.nbformat_minor) == (nbformat.current_nbformat, nbformat.current_nbformat_minor)
        assert all(c.get("id") for c in nb.cells) and all(not c.get("outputs") for c in nb.cells)
        assert nb.metadata["kernelspec"] == {"name": "python3", "display_name": spec.display_name,
                                             "language": spec.language}, path.name


@pytest.mark.browser
def test_the_demo_opens_with_the_gpu_panel_showing(tmp_path: Path) -> None:
    """A newcomer opens the URL the demo prints and sees the GPU panel without looking for it in the sidebar."""
    from browser_support import CHROMIUM, WAIT_MS, chromium_missing

    if (why := chromium_missing()) or not os.path.exists(CHROMIUM):
        pytest.skip(why or f"{CHROMIUM} is missing: run `make system-deps`")
    from playwright.sync_api import expect, sync_playwright

    demo, port, token = tmp_path / "demo", _free_port(), "p" * 32
    env = {**os.environ, "DEMO_PORT": str(port), "DEMO_GPUS": "2", "DEMO_TOKEN": token}
    env.pop("GPULEASE_BROKER", None)
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "demo.sh"), str(demo)], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:  # bounded by the demo's own start-up limits (it exits on failure)
            if line.startswith("Open http"):
                url = line.split()[1]
                break
        assert url.startswith(f"http://127.0.0.1:{port}/lab/tree/quickstart.ipynb"), url
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        expect.set_options(timeout=WAIT_MS)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url)
            expect(page.locator("#gpulease-panel")).to_be_visible()  # no click on the sidebar's tab
            expect(page.locator('.jp-SideBar.jp-mod-left li[data-id="gpulease-panel"]')).to_have_class(
                re.compile(r"\blm-mod-current\b"))
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # one Ctrl-C: the demo stops JupyterLab and the broker
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

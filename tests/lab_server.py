"""A real `jupyter lab` subprocess for browser tests: a free port, a token, isolated settings and root_dir."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# Keep the "Jupyter news" and update-check toasts out of the screenshots and the way of clicks.
OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LabServer:
    def __init__(self, workdir: Path, env: dict[str, str] | None = None, stdin: int | None = None) -> None:
        """``stdin``: the server's standard input (a terminal's, to stop it with Ctrl-C as in one); None: this
        process's."""
        self.workdir = Path(workdir)
        self.root_dir = self.workdir / "root"
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env or {}
        self.stdin = stdin
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "jupyter-lab.log"

    def start(self, timeout: float = 120.0) -> LabServer:
        settings = self.workdir / "app-settings"
        for d in (self.root_dir, settings, self.workdir / "user-settings", self.workdir / "workspaces",
                  self.workdir / "runtime"):
            d.mkdir(parents=True, exist_ok=True)
        (settings / "overrides.json").write_text(json.dumps(OVERRIDES))
        cmd = [
            sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={self.port}",
            "--ip=127.0.0.1", f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root_dir}",
            f"--LabApp.app_settings_dir={settings}", f"--LabApp.user_settings_dir={self.workdir / 'user-settings'}",
            f"--LabApp.workspaces_dir={self.workdir / 'workspaces'}", "--ServerApp.port_retries=0",
        ]
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(self.workdir / "runtime"), **self.env}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdin=self.stdin, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.root_dir, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.get("api/status")
                return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"jupyter lab did not answer within {timeout} s:\n{self.log()}")

    def get(self, path: str) -> dict:
        req = urllib.request.Request(f"{self.url}/{path}", headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"{self.url}/{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

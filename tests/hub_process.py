"""A real JupyterHub (``jupyterhub`` from PyPI, ``configurable-http-proxy`` from npm, installed by ``make test``) in
a temporary directory, with real single-user servers, for the tests of the broker's Hub identity.

The Hub is driven through its REST API with a test service's token (``tester``: create users, start servers,
issue and revoke users' tokens). Kernels are started in a user's own single-user server through the Hub's proxy
and run code over the kernel's websocket, as JupyterLab does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from lab_server import free_port

REPO = Path(__file__).resolve().parent.parent
TESTER_TOKEN = "tester-" + uuid.uuid4().hex  # the test service's Hub token (admin of the test Hub's users)


def proxy_command() -> str | None:
    """configurable-http-proxy: the one ``make test`` installs in .hub-proxy/, else one on PATH."""
    local = REPO / ".hub-proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
    return str(local) if local.exists() else shutil.which("configurable-http-proxy")


def hub_missing() -> str | None:
    """Why no Hub can start here (None: it can)."""
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        return "jupyterhub is not installed: `make test` installs the test extra (pip install -e '.[test]')"
    if proxy_command() is None:
        return ("configurable-http-proxy is missing: `make test` installs it (npm install --prefix .hub-proxy "
                "configurable-http-proxy)")
    return None


class HubProcess:
    """A JupyterHub process: ``config`` is extra lines of jupyterhub_config.py."""

    def __init__(self, workdir: Path, config: str = "", env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.hub_port, self.proxy_api_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"http://127.0.0.1:{self.hub_port}/hub/api"
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "jupyterhub.log"
        singleuser = Path(sys.executable).parent / "jupyterhub-singleuser"
        (self.workdir / "jupyterhub_config.py").write_text(f"""
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {self.port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {self.hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{self.proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{proxy_command()!r}]
c.JupyterHub.db_url = "sqlite:///{self.workdir}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{self.workdir}/jupyterhub_cookie_secret"
c.JupyterHub.pid_file = "{self.workdir}/jupyterhub.pid"
c.JupyterHub.cleanup_servers = False  # a stopped (and restarted) Hub leaves the single-user servers running
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = "test-password"
c.Authenticator.allow_all = True
c.Spawner.cmd = [{str(singleuser)!r}]
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.JupyterHub.services = [{{"name": "tester", "api_token": {TESTER_TOKEN!r}}}]
c.JupyterHub.load_roles = [{{"name": "tester", "services": ["tester"],
                             "scopes": ["admin:users", "admin:servers", "tokens", "admin:groups"]}}]
""" + config)

    # ------------------------------------------------------------------ process
    def start(self, timeout: float = 90.0) -> HubProcess:
        cmd = [sys.executable, "-m", "jupyterhub", "-f", str(self.workdir / "jupyterhub_config.py")]
        env = {**os.environ, **self.env}
        for name in ("GPULEASE_BROKER", "GPULEASE_TOKEN", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_API_URL"):
            env.pop(name, None)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyterhub exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.api("GET", "/")
                return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"jupyterhub did not answer within {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        """Stop the Hub (and its proxy); single-user servers keep running (cleanup_servers = False)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def shutdown(self) -> None:
        """Stop every single-user server, then the Hub."""
        if self.proc is not None and self.proc.poll() is None:
            for user in self.api("GET", "/users") or []:
                if user.get("server"):
                    try:
                        self.api("DELETE", f"/users/{user['name']}/server")
                    except OSError:
                        pass
            for user in self.api("GET", "/users") or []:
                if user.get("server") or user.get("pending"):
                    try:
                        self.wait_server(user["name"], stopped=True)
                    except AssertionError:
                        pass
        self.stop()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except FileNotFoundError:
            return ""

    # ------------------------------------------------------------------ REST
    def api(self, method: str, path: str, body: Any = None, token: str = TESTER_TOKEN) -> Any:
        """A call of the Hub's REST API (as the tester service unless ``token`` says otherwise)."""
        return _call(method, self.api_url + path, body, token)

    def user(self, name: str, groups: tuple[str, ...] = ()) -> None:
        try:
            self.api("POST", f"/users/{name}")
        except urllib.error.HTTPError as e:
            if e.code != 409:  # exists already
                raise
        for g in groups:
            self.api("POST", f"/groups/{g}/users", {"users": [name]})

    def token(self, name: str, note: str = "test") -> tuple[str, str]:
        """A new API token of ``name`` (it inherits the user's permissions): (token, token id)."""
        t = self.api("POST", f"/users/{name}/tokens", {"note": note, "expires_in": 3600})
        return t["token"], t["id"]

    def revoke(self, name: str, token_id: str) -> None:
        self.api("DELETE", f"/users/{name}/tokens/{token_id}")

    def start_server(self, name: str) -> None:
        try:
            self.api("POST", f"/users/{name}/server")
        except urllib.error.HTTPError as e:
            if e.code != 400:  # running already
                raise
        self.wait_server(name)

    def wait_server(self, name: str, stopped: bool = False, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.api("GET", f"/users/{name}")
            ready = model.get("server") and not model.get("pending")
            if (not model.get("server") and not model.get("pending")) if stopped else ready:
                return
            time.sleep(0.25)
        raise AssertionError(f"{name}'s server did not {'stop' if stopped else 'start'} within {timeout} s:\n"
                             f"{self.log()}")

    def server(self, name: str, method: str, path: str, token: str, body: Any = None) -> Any:
        """A call of ``name``'s single-user server through the Hub's proxy, e.g. ``/api/kernels``."""
        return _call(method, f"{self.url}/user/{name}{path}", body, token)

    def run_in_kernel(self, name: str, token: str, *cells: str, timeout: float = 120.0) -> dict[str, Any]:
        """Start a kernel in ``name``'s server, run ``cells`` in it one after another (stopping at an error),
        stop it: {stdout, stderr, error}."""
        import websocket

        kernel = self.server(name, "POST", "/api/kernels", token, {"name": "python3"})
        ws = websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/user/{name}/api/kernels/{kernel['id']}/channels",
            header=[f"Authorization: token {token}"], timeout=timeout)
        out: dict[str, Any] = {"stdout": "", "stderr": "", "error": None}
        try:
            for code in cells:
                self._execute(ws, name, code, out, timeout)
                if out["error"]:
                    break
            return out
        finally:
            ws.close()
            self.server(name, "DELETE", f"/api/kernels/{kernel['id']}", token)

    @staticmethod
    def _execute(ws: Any, name: str, code: str, out: dict[str, Any], timeout: float) -> None:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": name, "session": uuid.uuid4().hex, "msg_type": "execute_request",
                       "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "error":
                out["error"] = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                return
        raise AssertionError(f"a cell in {name}'s kernel did not finish within {timeout} s: {out}")


def _call(method: str, url: str, body: Any, token: str) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
    return json.loads(raw) if raw else None

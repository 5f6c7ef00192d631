"""A real JupyterHub whose users are real Unix users (LocalProcessSpawner, as The Littlest JupyterHub and
SystemdSpawner run them), with the broker's default identity 'unix': each user's server and kernels are their uid.

Each user runs a %%gpu cell through their own server and sees and can release only their own leases; a per-user
quota holds. Needs root (CI runs as root) to create the users and to let the Hub start servers as them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_process import BrokerProcess
from hub_process import HubProcess, hub_missing

pytestmark = pytest.mark.timeout(600)

USERS = ("gl-hub-ann", "gl-hub-ben")


def _unix_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)


def _closed_to_others(path: Path) -> Path | None:
    """The first directory on ``path`` that other users cannot enter, or None."""
    for d in path.parents:
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def _python_for_others(workdir: Path) -> tuple[list[str] | None, str]:
    """A command that starts a single-user server and that other Unix users can run, or (None, why not).

    This Python may live where other users cannot enter (pyenv under /root, mode 0700). Then a virtualenv of the
    system's Python of the same version is made in ``workdir``; it sees this environment's packages (and the
    project, installed editable) through a .pth file, as long as they are where others may read them."""
    me = Path(os.path.realpath(sys.executable))
    if _closed_to_others(me) is None:
        return [str(Path(sys.executable).parent / "jupyterhub-singleuser")], ""
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    site = Path(sysconfig.get_paths()["purelib"])
    closed = _closed_to_others(site / "x") or _closed_to_others(Path(__file__))
    if not system.exists() or closed is not None:
        return None, (f"other Unix users cannot run this Python ({me}: {_closed_to_others(me)} is closed to them), "
                      f"and {'no ' + str(system) if not system.exists() else str(closed) + ' is closed to them too'}:"
                      " install Python and the project where every user can read them")
    venv = workdir / "py"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True)
    theirs = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                  "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    (theirs / "gpulease_tests.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
    return [str(venv / "bin" / "python"), "-m", "jupyterhub.singleuser"], ""


@pytest.fixture(scope="module")
def hub_broker() -> Iterator[tuple[HubProcess, BrokerProcess]]:
    why = hub_missing() or (None if os.geteuid() == 0 else "needs root to create Unix users and spawn as them")
    if why:
        pytest.skip(why)
    workdir = Path(tempfile.mkdtemp(prefix="gl-hubu"))
    os.chmod(workdir, 0o755)
    singleuser, why = _python_for_others(workdir)
    if singleuser is None:
        shutil.rmtree(workdir, ignore_errors=True)
        pytest.skip(why)
    for name in USERS:
        _unix_user(name)
    broker_dir, hub_dir = workdir / "broker", workdir / "hub"
    broker_dir.mkdir()
    broker = BrokerProcess(broker_dir, gpus=4, socket_path=str(workdir / "b.sock"),
                           args=["--tick=0.1", "--LeasePolicy.max_gpus_per_user=1"])
    hub = HubProcess(hub_dir, config=textwrap.dedent(f"""
        c.JupyterHub.spawner_class = "localprocess"  # each user's server as their own Unix user
        c.Spawner.cmd = {singleuser!r}
        c.Spawner.environment = {{"GPULEASE_BROKER": {broker.url!r}}}
        """))
    broker.start()
    hub.start()
    try:
        for name in USERS:
            hub.user(name)
        yield hub, broker
    finally:
        hub.shutdown()
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


CELLS = (
    "%load_ext jupyter_gpulease",
    "%%gpu 1\nimport os, pwd\nprint('ran as', pwd.getpwuid(os.getuid()).pw_name, os.environ['CUDA_VISIBLE_DEVICES'] != '')",
    textwrap.dedent("""
        from jupyter_gpulease.client import BrokerClient, BrokerError
        c = BrokerClient()
        def status(call):
            try:
                call()
                return 200
            except BrokerError as e:
                return e.status
        print("user", c.info()["user"]["name"])
        print("two", status(lambda: c.request_lease(2, heartbeat=False)))
        held = c.request_lease(1, heartbeat=False)
        print("held", held.id)
        """),
)


def test_each_unix_user_runs_cells_and_acts_only_on_their_own_leases(hub_broker) -> None:
    hub, broker = hub_broker
    ann, ben = USERS
    tokens = {name: hub.token(name)[0] for name in USERS}
    for name in USERS:
        hub.start_server(name)
    out = hub.run_in_kernel(ann, tokens[ann], *CELLS)
    assert out["error"] is None, out
    assert f"ran as {ann} True" in out["stdout"], out
    assert f"user {ann}" in out["stdout"], out
    assert "two 403" in out["stdout"], out  # max_gpus_per_user = 1
    held = out["stdout"].split("held ")[1].split()[0]
    out = hub.run_in_kernel(ben, tokens[ben], *CELLS[:2], textwrap.dedent(f"""
        from jupyter_gpulease.client import BrokerClient, BrokerError
        c = BrokerClient()
        def status(call):
            try:
                call()
                return 200
            except BrokerError as e:
                return e.status
        print("user", c.info()["user"]["name"])
        print("sees", {held!r} in [x.id for x in c.leases()], "users", sorted({{x.user for x in c.leases()}}))
        print("release", status(lambda: c.release({held!r})))
        print("renew", status(lambda: c.renew({held!r}, 60)))
        """))
    assert out["error"] is None, out
    assert f"ran as {ben} True" in out["stdout"], out
    # ben sees none of ann's leases (his own cell's may still be live: it is released as its worker exits)
    assert f"user {ben}\nsees False users {[ben]!r}\nrelease 403\nrenew 403" in out["stdout"] or \
        f"user {ben}\nsees False users []\nrelease 403\nrenew 403" in out["stdout"], out
    # ann's lease is untouched: she releases it from her own kernel
    out = hub.run_in_kernel(ann, tokens[ann], "from jupyter_gpulease.client import BrokerClient\n"
                            f"print(BrokerClient().lease({held!r}).state, BrokerClient().release({held!r}).state)")
    assert out["error"] is None, out
    assert "granted released" in out["stdout"], out

"""A real Slurm (Debian's slurm-wlm and munge) entirely under a temporary directory, for tests and benchmarks.

One ``munged`` (as the munge user), one ``slurmctld`` and two ``slurmd`` on this host: ``n1``
with 4 GPUs and ``n2`` with 2, on distinct ports, all ``NodeAddr=127.0.0.1``. The GPUs are
character devices made with ``mknod`` in the directory (Slurm refuses regular files and a bare
``Count=``). Every daemon runs in the foreground as our child and is stopped by its PID; jobs
are cancelled first, and a ``slurmstepd`` left behind is found by the spool directory it names
and killed by PID. Needs root (the daemons, ``mknod``, ``runuser``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("salloc", "srun", "scancel", "squeue", "sinfo", "scontrol")
NODES = {"n1": 4, "n2": 2}
PARTITION = "gpu"
MAX_TIME_MINUTES = 120  # the partition's MaxTime: Slurm's own limit, which tests run into on purpose
CPUS = 16  # declared per node (config_overrides): more than this host has, so CPUs never limit the GPU tests


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def slurm_missing() -> str:
    """Why a local Slurm cannot be started here ('' when it can)."""
    if os.geteuid() != 0:
        return ("a local Slurm needs root (slurmd, mknod, runuser -u munge): run the tests as root, "
                "after `make system-deps`")
    missing = [n for n in DAEMONS + CLIENTS if not _which(n)]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): `make system-deps` as root installs "
                "Debian's slurm-wlm, slurm-client and munge")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the munge user does not exist: reinstall Debian's munge package (`make system-deps`)"
    return ""


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class LocalSlurmCluster:
    def __init__(self, root: Path, nodes: dict[str, int] | None = None,
                 private: dict[str, list[str]] | None = None) -> None:
        """``private``: nodes whose slurmd (and so every step on them) runs in its own mount namespace, with an
        empty tmpfs over each of the paths named, and over /dev/shm (``ray_cluster.private_mounts``)."""
        self.root = Path(root)
        self.nodes = dict(nodes or NODES)
        self.private = dict(private or {})
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # ---------------------------------------------------------------- environment
    @property
    def env(self) -> dict[str, str]:
        """Environment for processes that use this cluster (broker, kernels, clients)."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """A Slurm client command against this cluster; its stdout."""
        p = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    # ---------------------------------------------------------------- files
    def _write_config(self) -> None:
        ctld, *node_ports = _free_ports(1 + len(self.nodes))
        r = self.root
        node_lines = []
        for (name, gpus), port in zip(self.nodes.items(), node_ports, strict=True):
            dev = r / "dev" / name
            dev.mkdir(parents=True)
            for i in range(gpus):
                os.mknod(dev / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))  # S_IFCHR
            node_lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname=localhost Port={port} "
                              f"CPUs={CPUS} RealMemory=4000 Gres=gpu:{gpus} State=UNKNOWN")
        names = ",".join(self.nodes)
        (r / "etc" / "slurm.conf").write_text("\n".join([
            "ClusterName=gpulease-test",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "SlurmdParameters=config_overrides",  # CPUs as declared, not as this host has
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0",  # else back-to-back jobs start ~3 s late
            "KillWait=2",
            "ReturnToService=1",  # a node set DOWN stays down until resumed (2 would return it at once)
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "MinJobAge=30",
            *node_lines,
            f"PartitionName={PARTITION} Nodes={names} Default=YES MaxTime={MAX_TIME_MINUTES} State=UP",
            "",
        ]))
        (r / "etc" / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={name} Name=gpu File={r}/dev/{name}/nvidia[0-{gpus - 1}]\n" if gpus > 1 else
            f"NodeName={name} Name=gpu File={r}/dev/{name}/nvidia0\n"
            for name, gpus in self.nodes.items()
        ))

    def _start_munge(self) -> None:
        mdir = self.root / "munge"
        mdir.mkdir()
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        munge = pwd.getpwnam("munge")
        for p in (mdir, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)
        mdir.chmod(0o755)  # clients (any user) must reach the socket
        self.root.chmod(0o755)
        self._spawn("munged", ["runuser", "-u", "munge", "--", _which("munged") or "munged", "--foreground",
                               f"--socket={self.munge_socket}", f"--key-file={key}", f"--pid-file={mdir}/munged.pid",
                               f"--log-file={mdir}/munged.log", f"--seed-file={mdir}/munged.seed", "--num-threads=2"])
        self._wait(lambda: self.munge_socket.exists(), 10, "munged's socket")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **self.env}, start_new_session=True)
        log.close()

    def _wait(self, cond: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():  # type: ignore[operator]
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout} s waiting for {what}:\n{self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            with contextlib.suppress(OSError):
                out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-2000:])
        return "\n".join(out)

    # ---------------------------------------------------------------- life cycle
    def start(self) -> LocalSlurmCluster:
        for d in ("etc", "state", "spool", "run", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._start_munge()
        self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)])
        for name in self.nodes:
            (self.root / "spool" / name).mkdir()
            slurmd = [_which("slurmd") or "slurmd", "-D", "-N", name, "-f", str(self.conf)]
            if name in self.private:
                from ray_cluster import private_mounts

                slurmd = [*private_mounts([*self.private[name], "/dev/shm"]), *slurmd]
            self._spawn(f"slurmd-{name}", slurmd)
        self._wait(self._all_idle, 30, "both nodes idle in sinfo")
        return self

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return {n: s for n, s in (line.split() for line in out.splitlines() if line.strip())}

    def _all_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(n, "").rstrip("*") == "idle" for n in self.nodes)

    def jobs(self) -> list[dict[str, str]]:
        """Jobs Slurm still has pending, running or completing."""
        out = self.run("squeue", "-h", "-o", "%i|%j|%T|%N|%r")
        keys = ("id", "name", "state", "nodes", "reason")
        return [dict(zip(keys, line.split("|", 4), strict=True)) for line in out.splitlines() if line.strip()]

    def free_gpus(self) -> int:
        """GPUs Slurm has not allocated to any job (on nodes that are up)."""
        out = self.run("sinfo", "--noheader", "--Node", f"--partition={PARTITION}", "--Format=NodeList:|,Gres:|,GresUsed:|,StateCompact:|")
        free = 0
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) < 4 or parts[3].rstrip("*").startswith(("down", "drain", "fail")):
                continue
            total, used = (sum(int(n) for n in re.findall(r"gpu(?::[^:,()]+)?:(\d+)", f)) for f in parts[1:3])
            free += total - used
        return free

    def node_down(self, node: str, reason: str) -> None:
        self.run("scontrol", "update", f"NodeName={node}", "State=DOWN", f"Reason={reason}")

    def node_resume(self, node: str) -> None:
        if self.node_states().get(node, "").rstrip("*") != "idle":
            self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        self._wait(lambda: self.node_states().get(node, "").rstrip("*") == "idle", 30, f"{node} idle again")

    def cancel_all(self) -> None:
        self.run("scancel", "--full", "--quiet", f"--user={os.getuid()}", check=False)

    def stop(self) -> None:
        """Cancel every job, stop the daemons by PID, kill any slurmstepd of ours that is left."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.cancel_all()
                deadline = time.monotonic() + 10
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.1)
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def leftovers(self) -> list[int]:
        """PIDs of Slurm or munge processes still running that belong to this cluster (they name its directory
        on their command line or in their environment: SLURM_CONF)."""
        mine = str(self.root).encode()
        names = {b"slurmstepd", b"slurmd", b"slurmctld", b"munged", b"srun", b"salloc"}
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            argv0 = os.path.basename(cmd.split(b"\0", 1)[0]).split(b":")[0].strip()
            if argv0 in names and (mine in cmd or mine in env):
                pids.append(int(d))
        return pids


@contextmanager
def local_slurm_cluster(root: Path | None = None,
                        private: dict[str, list[str]] | None = None) -> Iterator[LocalSlurmCluster]:
    """A started cluster under ``root`` (default: a new temporary directory, removed afterwards); ``private``: see
    ``LocalSlurmCluster``."""
    own = root is None
    # short: Slurm and munge put socket paths under it
    base = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp")) if own else Path(root)  # type: ignore[arg-type]
    c = LocalSlurmCluster(base, private=private)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        if own:
            shutil.rmtree(base, ignore_errors=True)

"""Driving Slurm's client commands for the Slurm inventory: salloc's command line, scancel, squeue, sinfo
and scontrol, and parsing what they say (host lists, GRES, GPU indices, node and job states)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.errors import LeaseError
from ..core.lease import Lease

#: pending reasons that only mean "wait": anything else is a limit or a refusal, and fails the lease
WAIT_REASONS = frozenset({"None", "Resources", "Priority", "Prolog", "BeginTime", "Dependency", "Configuring",
                          "NodeDown", "ReqNodeNotAvail", ""})
#: job states in which the allocation still holds its GPUs
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "RESIZING", "REQUEUED",
                         "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED"})
#: node states (sinfo %T, without flags) whose jobs Slurm has killed: the node's GPUs leave the inventory
LOST_STATES = ("down", "fail", "unknown", "future", "inval", "power_down", "powered_down", "powering_down")
#: node states in which running jobs go on but nothing new starts
CLOSED_STATES = ("drain", "drained", "draining", "failing", "maint", "reboot", "reserved", "powering_up")

_GRES_RE = re.compile(r"(?:^|,)gpu(?::([^:,()]+))?:(\d+)")
_ALLOC_RE = re.compile(r"(Granted|Pending) job allocation (\d+)")
_IDX_RE = re.compile(r"\bNodes=(\S+)\s.*?GRES=\S*?gpu[^\s(]*\(IDX:([0-9,\-]+)\)")


def expand_hostlist(text: str) -> list[str]:
    """``n[1-3,5],gpu07`` -> ``['n1', 'n2', 'n3', 'n5', 'gpu07']`` (Slurm's host list syntax)."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", text):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not ranges:
            out.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return out


def expand_indices(text: str) -> list[int]:
    """``0-1,3`` -> ``[0, 1, 3]``."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def gpu_id(node: str, index: int) -> str:
    return f"slurm:{node}:{index}"


def _id_node(gid: str) -> str:
    return gid.split(":")[1]


@dataclass
class Node:
    name: str
    gpus: int
    gpu_type: str
    state: str  # sinfo %T without its flags, e.g. idle, mixed, down, drained
    responding: bool
    reason: str

    @property
    def lost(self) -> bool:
        return self.state.startswith(LOST_STATES) or not self.responding

    @property
    def closed(self) -> bool:
        return self.state.startswith(CLOSED_STATES)

    def describe(self) -> str:
        state = self.state + ("" if self.responding else ", not responding")
        return f"Slurm: {state}" + (f": {self.reason}" if self.reason and self.reason != "none" else "")


@dataclass
class Job:
    id: str
    name: str
    state: str
    reason: str
    nodes: str


@dataclass
class Snapshot:
    """What Slurm said in one refresh (taken off the event loop, applied on it)."""

    started: float  # monotonic time the refresh began
    nodes: dict[str, Node]
    jobs: dict[str, Job]  # by job name


def _per_node(devices: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in devices:
        node = _id_node(d)
        out[node] = out.get(node, 0) + 1
    return out


def _slurm_message(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return " ".join(lines)[-300:] or "no message"


def _reason(text: str) -> str:
    return " ".join(text.split())[:240]


class SlurmSettings(Protocol):
    """What the commands read of the Slurm inventory's configuration."""

    partition: str
    account: str
    job_prefix: str
    salloc_args: list[str]
    command_timeout: float
    charge_users: bool


class SlurmCommands:
    """Slurm's client commands as the Slurm inventory runs them, and what it learned of the cluster at setup."""

    def __init__(self, settings: SlurmSettings) -> None:
        self.settings = settings
        self.partition = settings.partition  # the cluster's default partition when the setting is empty
        self.cluster = ""
        self.no_requeue = False
        self.as_users = False  # allocations are submitted as the lease's Unix user (salloc --uid/--gid)
        self.env = dict(os.environ)
        self._checked = False

    # ---------------------------------------------------------------- commands
    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.settings.command_timeout,
                               env=self.env)
        except subprocess.TimeoutExpired:
            raise LeaseError(f"Slurm: `{' '.join(cmd[:3])} ...` did not answer within {self.settings.command_timeout:g} s "
                             "(SlurmInventory.command_timeout)", reason="slurm_unavailable") from None
        if check and p.returncode:
            raise LeaseError(f"Slurm: `{' '.join(cmd[:3])} ...` failed: {_slurm_message(p.stderr)}",
                             reason="slurm_unavailable")
        return p

    def check_setup(self) -> None:
        if self._checked:
            return
        missing = [c for c in ("salloc", "scancel", "squeue", "sinfo", "scontrol") if not shutil.which(c)]
        if missing:
            raise LeaseError(f"The Slurm inventory needs Slurm's client commands ({', '.join(missing)} not on PATH): "
                             "install slurm-client (and munge) on the broker's host, or choose another --inventory",
                             reason="startup")
        try:
            config = self.run("scontrol", "show", "config").stdout
        except LeaseError as e:
            raise LeaseError(f"Cannot reach the Slurm controller ({e}): check $SLURM_CONF and munge on this host, "
                             "or choose another --inventory", reason="startup") from None
        m = re.search(r"^ClusterName\s*=\s*(\S+)", config, re.MULTILINE)
        self.cluster = m.group(1) if m else ""
        salloc_help = self.run("salloc", "--help", check=False).stdout
        self.no_requeue = "--no-requeue" in salloc_help
        # root may submit as the user (Slurm's accounting and fair share then charge them); salloc drops to that
        # uid once the allocation is made (with --no-shell it has nothing left to do)
        self.as_users = self.settings.charge_users and os.geteuid() == 0 and "--uid" in salloc_help
        if not self.partition:
            parts = self.run("sinfo", "--noheader", "--format=%P").stdout.split()
            default = [p.rstrip("*") for p in parts if p.endswith("*")]
            if not default:
                raise LeaseError("Slurm has no default partition: set --SlurmInventory.partition", reason="startup")
            self.partition = default[0]
        self._checked = True

    # ---------------------------------------------------------------- nodes and jobs
    def read_nodes(self) -> dict[str, Node]:
        out = self.run("sinfo", "--noheader", "--Node", f"--partition={self.partition}",
                        "--format=%N|%G|%T|%E").stdout
        nodes: dict[str, Node] = {}
        for line in out.splitlines():
            name, gres, state, reason = (line.split("|", 3) + ["", "", ""])[:4]
            if not name or name in nodes:
                continue
            gpus = [(m.group(1) or "", int(m.group(2))) for m in _GRES_RE.finditer(gres)]
            responding = not state.endswith("*")
            nodes[name] = Node(name, sum(n for _, n in gpus), ",".join(sorted({t for t, _ in gpus if t})),
                               state.rstrip("*~#!%$@^-+"), responding, reason.strip())
        return nodes

    def mine(self) -> list[str]:
        """squeue's and scancel's user filter: the broker's own jobs, or every user's when it submits as them
        (its jobs are then known by name only: ``<job_prefix>-<lease id>``)."""
        return [] if self.as_users else [f"--user={os.getuid()}"]

    def read_jobs(self) -> dict[str, Job]:
        out = self.run("squeue", "--noheader", "--states=all", *self.mine(), "--format=%i|%T|%r|%N|%j").stdout
        jobs: dict[str, Job] = {}
        ours = re.compile(re.escape(self.settings.job_prefix) + r"-l-[0-9a-f]+")  # lease ids: l-<hex>
        for line in out.splitlines():
            parts = line.split("|", 4)
            if len(parts) == 5 and ours.fullmatch(parts[4]):
                job = Job(parts[0], parts[4], parts[1], parts[2], parts[3])
                prev = jobs.get(job.name)
                if prev is None or int(job.id) > int(prev.id):  # a resubmitted allocation replaces an old one
                    jobs[job.name] = job
        return jobs

    # ---------------------------------------------------------------- allocations
    def job_name(self, lease_id: str) -> str:
        return f"{self.settings.job_prefix}-{lease_id}"

    def salloc_command(self, lease: Lease, minutes: int) -> list[str]:
        per_node = _per_node(lease.devices)
        counts = set(per_node.values())
        cmd = ["salloc", "--no-shell", f"--job-name={self.job_name(lease.id)}", f"--partition={self.partition}",
               f"--nodelist={','.join(per_node)}", f"--nodes={len(per_node)}", "--ntasks-per-node=1",
               f"--time={minutes}", f"--comment=jupyter-gpulease lease {lease.id} of {lease.user}"]
        # the same count everywhere: GRES per node (each node exactly); else the total, Slurm spreads it
        cmd.append(f"--gres=gpu:{counts.pop()}" if len(counts) == 1 else f"--gpus={len(lease.devices)}")
        if self.settings.account:
            cmd.append(f"--account={self.settings.account}")
        cmd += self.submit_as(lease.user)
        if self.no_requeue:
            cmd.append("--no-requeue")
        return cmd + list(self.settings.salloc_args)

    def submit_as(self, user: str) -> list[str]:
        """``--uid``/``--gid`` of the lease's user when the broker submits as users and the user is a Unix user
        here (a JupyterHub identity without one is charged to the broker's account)."""
        if not self.as_users:
            return []
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            return []
        return [f"--uid={pw.pw_uid}", f"--gid={pw.pw_gid}"]

    def allocation_nodes(self, job_id: str) -> list[dict[str, Any]]:
        """Per node of the job, the GPU indices Slurm gave it (``scontrol show job -d``)."""
        text = self.run("scontrol", "--details", "show", "job", job_id).stdout
        nodes: list[dict[str, Any]] = []
        for m in _IDX_RE.finditer(text):
            indices = expand_indices(m.group(2))
            for node in expand_hostlist(m.group(1)):
                nodes.append({"node": node, "gpus": len(indices), "indices": indices})
        return nodes

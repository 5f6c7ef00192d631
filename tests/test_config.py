"""Every configurable trait says what it means; the generated config documents them all."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from broker_process import BrokerProcess
from traitlets.config import Configurable

import jupyter_gpulease
import lease_broker
from jupyter_gpulease.client import BrokerError


def _configurables():
    seen = set()
    for pkg in (lease_broker, jupyter_gpulease):
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if ".labextension" in mod.name or mod.name.endswith("__main__"):
                continue
            try:
                m = importlib.import_module(mod.name)
            except ImportError:  # optional backends (ray) may be absent: their own tests say so
                continue
            for obj in vars(m).values():
                if isinstance(obj, type) and issubclass(obj, Configurable) and obj.__module__ == m.__name__:
                    seen.add(obj)
    return seen


def test_every_configurable_trait_has_help():
    classes = _configurables()
    assert any(c.__name__ == "LeasePolicy" for c in classes)
    missing = [
        f"{cls.__name__}.{name}"
        for cls in classes
        for name, trait in cls.class_traits(config=True).items()
        if not (trait.help or "").strip()
    ]
    assert missing == []


def test_generate_config_documents_policy():
    out = subprocess.run([sys.executable, "-m", "lease_broker", "--generate-config"], capture_output=True,
                         text=True, cwd="/tmp", timeout=60, check=True)
    text = out.stdout
    compile(text, "lease_broker_config.py", "exec")  # a valid Python config file
    for option in ("max_duration_seconds", "heartbeat_timeout", "max_gpus_per_user", "inventory_class"):
        assert option in text, option


def test_invalid_policy_value_is_quoted(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lease_broker", "--inventory=simulated",
                          "--LeasePolicy.term_timeout=-1", f"--socket={tmp_path}/s", f"--db={tmp_path}/d"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "term_timeout" in out.stderr and "-1" in out.stderr


def test_executors_are_chosen_by_entry_point_name() -> None:
    from traitlets import TraitError

    from jupyter_gpulease.executors import executor_class
    from jupyter_gpulease.executors.local import LocalExecutor
    from jupyter_gpulease.executors.slurm import SlurmExecutor

    assert executor_class("local") is LocalExecutor
    assert executor_class("jupyter_gpulease.executors.slurm:SlurmExecutor") is SlurmExecutor
    with pytest.raises(TraitError) as refused:
        executor_class("k8s")
    assert all(name in str(refused.value) for name in ("'k8s'", "local", "ray", "slurm"))
    with pytest.raises(TraitError, match="not a subclass of Executor"):
        executor_class("jupyter_gpulease.executors.local:WarmPool")


def test_an_unknown_inventory_is_refused_naming_the_installed_ones(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "lease_broker", "--inventory=k8s", f"--socket={tmp_path}/s",
                          f"--db={tmp_path}/d"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert all(name in out.stderr for name in ("inventory_class", "'k8s'", "nvml", "simulated", "ray", "slurm"))


def test_inventory_policy_and_store_classes_are_swapped_by_config(tmp_path: Path) -> None:
    """A real broker built from other classes: the inventory as 'module:Class', a LeasePolicy subclass and a
    Store subclass from a module of the admin's."""
    (tmp_path / "site_parts.py").write_text(
        "from lease_broker.policy.lease_policy import LeasePolicy\n"
        "from lease_broker.policy.numbers import Float\n"
        "from lease_broker.store.lease_store import Store\n"
        "class OneGpuPolicy(LeasePolicy):\n"
        "    max_gpus_per_user = Float(1.0, config=True, help='one GPU each')\n"
        "class MarkedStore(Store):\n"
        "    def __init__(self, path):\n"
        "        super().__init__(path)\n"
        "        open(path + '.marked', 'w').close()\n")
    broker = BrokerProcess(tmp_path / "b", gpus=2, env={"PYTHONPATH": str(tmp_path)}, args=[
        "--LeaseBroker.inventory_class=lease_broker.inventory.simulated:SimulatedInventory",
        "--LeaseBroker.policy_class=site_parts.OneGpuPolicy", "--LeaseBroker.store_class=site_parts.MarkedStore"])
    broker.start()
    try:
        client = broker.client()
        assert client.gpus()["simulated"] is True
        with pytest.raises(BrokerError) as refused:
            client.request_lease(gpus=2)
        assert (refused.value.status, refused.value.reason) == (403, "quota")
        assert client.request_lease(gpus=1).state == "granted"
        assert Path(broker.db + ".marked").exists()
    finally:
        broker.stop()


def test_policy_answers_are_forgotten_by_its_one_reload() -> None:
    """Limits are kept per user until the policy's ``reload()``: on a change of an option, or SIGHUP."""
    from lease_broker.policy.lease_policy import LeasePolicy

    policy = LeasePolicy(group_members={"ml": ["ann"]}, group_limits={"ml": {"max_gpus": 2}}, unix_groups=False)
    assert (policy.limit("ann", "max_gpus"), policy.groups_of("ann")) == (2, ("ml",))
    policy.group_limits = {"ml": {"max_gpus": 3}}  # a change of an option (API, SIGHUP) reloads
    assert policy.limit("ann", "max_gpus") == 3
    assert policy.learn_groups("bob", ("ml",)) and not policy.learn_groups("bob", ("ml",))
    assert policy.limit("bob", "max_gpus") == 3
    policy.limits.answers[("ann", "max_gpus")] = 9  # a kept answer stands until the reload
    assert policy.limit("ann", "max_gpus") == 9
    policy.reload()
    assert policy.limit("ann", "max_gpus") == 3 and policy.groups_of("bob") == ("ml",)  # learned groups stay

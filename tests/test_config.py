"""Every configurable trait says what it means; the generated config documents them all."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

from traitlets.config import Configurable

import jupyter_gpulease
import lease_broker


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
    for option in ("max_duration_seconds", "heartbeat_timeout", "max_gpus_per_user", "inventory_name"):
        assert option in text, option


def test_invalid_policy_value_is_quoted(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lease_broker", "--inventory=simulated",
                          "--LeasePolicy.term_timeout=-1", f"--socket={tmp_path}/s", f"--db={tmp_path}/d"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "term_timeout" in out.stderr and "-1" in out.stderr

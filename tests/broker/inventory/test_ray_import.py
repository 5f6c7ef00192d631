"""``import ray`` without rfc3987_syntax's IRI grammar (``executors.ray_lazy_import``): in the kernel, and in the Ray
worker processes of a node whose ``ray start`` has the site directory first on PYTHONPATH; the grammar is built when
something first checks an IRI, and jsonschema's IRI checks still work. A fresh interpreter each time (what is
imported is the point)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray_cluster import ray_missing

from jupyter_gpulease.executors.ray_lazy_import import site_dir

pytestmark = [
    pytest.mark.skipif(bool(ray_missing()), reason=ray_missing() or "ray installed"),
    pytest.mark.skipif(importlib.util.find_spec("rfc3987_syntax") is None,
                       reason="rfc3987_syntax is not installed: nothing to defer"),
]

#: what a process reports: whether the grammar was built by ``import ray``, and jsonschema's iri checks after
CHECK = """import json
def check():
    import json, sys
    import ray, jsonschema
    built = 'rfc3987_syntax.syntax_helpers' in sys.modules
    v = jsonschema.Draft202012Validator({'format': 'iri'}, format_checker=jsonschema.FormatChecker())
    bad = [e.validator for e in v.iter_errors('not an iri ::')]
    good = [e.validator for e in v.iter_errors('http://example.org/\\u00e4')]
    import rfc3987_syntax
    return {'built_at_import': built, 'bad': bad, 'good': good,
            'real_after': rfc3987_syntax.is_valid_syntax.__module__,
            'parse': rfc3987_syntax.parse('iri', 'http://a/b').data}
"""

KERNEL = CHECK + """
from jupyter_gpulease.executors.ray_lazy_import import defer_iri_grammar
defer_iri_grammar()
print(json.dumps(check()))
"""


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _deferred_and_checks_work(seen: dict) -> None:
    assert seen["built_at_import"] is False
    assert seen["bad"] == ["format"]
    assert seen["good"] == []
    assert seen["real_after"] == "rfc3987_syntax.syntax_helpers"  # the real module replaced the stand-in
    assert seen["parse"] == "iri"


def test_ray_import_in_the_kernel_defers_the_iri_grammar_and_iri_checks_still_work() -> None:
    _deferred_and_checks_work(_run(KERNEL))


def test_ray_import_site_dir_defers_the_grammar_and_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_OWN_RAN'] = '1'\n")
    paths = os.pathsep.join([site_dir(), str(site), os.environ.get("PYTHONPATH", "")])
    code = CHECK + "import os\nseen = check()\nseen['own'] = os.environ.get('SITE_OWN_RAN')\nprint(json.dumps(seen))"
    seen = _run(code, {"PYTHONPATH": paths})
    _deferred_and_checks_work(seen)
    assert seen["own"] == "1"  # the site's own sitecustomize still ran


RAY_NODE = CHECK + """
import os, sys
sys.path.insert(0, TESTS)
from ray_cluster import local_ray_cluster
import ray
from jupyter_gpulease.executors.ray import CellProcess

@ray.remote(num_cpus=0)
def task():
    return check()

with local_ray_cluster() as c:  # its raylets inherit this process's PYTHONPATH, site dir first
    seen = ray.get(task.remote(), timeout=120)
    actor = ray.remote(CellProcess).options(num_cpus=0).remote(sys.executable, [], {})
    info = ray.get(actor.info.remote(), timeout=120)
    env = dict(line.split("=", 1) for line in open(f"/proc/{info['pid']}/environ").read().split("\\0") if "=" in line)
    seen["cell_pythonpath"] = env.get("PYTHONPATH", "")
    seen["actor_pythonpath"] = ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("PYTHONPATH", "")))
    ray.kill(actor)
print(json.dumps(seen))
"""


def test_ray_import_in_workers_of_a_node_started_with_the_site_dir_defers_the_grammar_not_in_the_cell() -> None:
    tests = str(Path(__file__).resolve().parents[2])
    paths = os.pathsep.join(p for p in [site_dir(), os.environ.get("PYTHONPATH", "")] if p)
    seen = _run(RAY_NODE.replace("TESTS", repr(tests)), {"PYTHONPATH": paths}, timeout=300)
    _deferred_and_checks_work(seen)  # in a Ray worker process (a task's)
    assert site_dir() in seen["actor_pythonpath"].split(os.pathsep)
    assert site_dir() not in seen["cell_pythonpath"].split(os.pathsep)  # the cell's interpreter: not ours

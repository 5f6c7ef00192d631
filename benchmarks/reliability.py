"""Reliability: the fault, security and fuzz tests run, and what they measured, as figures.

Runs ``tests/broker/service/test_faults.py``, every test marked ``attack`` (the attacks of another local user, a Hub
user and bad input: ``test_security.py``, ``test_socket_trust.py``, ``test_private_state.py``, …) and the schemathesis
test of ``tests/test_openapi.py`` with pytest (the fuzzer with ``GPULEASE_FUZZ_EXAMPLES`` examples per operation
and mode), collects what the tests record (``GPULEASE_RELIABILITY_LOG``, ``GPULEASE_FUZZ_STATS``) and the
load run of the same invocation (``--only load --only reliability``; alone it runs a 10 s load itself).
Nothing here is typed by hand: every number comes from a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from .report import Figure, figure

TITLE = "Reliability"
ROOT = Path(__file__).resolve().parent.parent


def _pytest(args: list[str], env: dict[str, str], junit: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        cases.append({"name": case.get("name", ""), "outcome": outcome, "seconds": float(case.get("time", 0))})
    return {"returncode": proc.returncode, "cases": cases, "tail": proc.stdout[-1500:]}


def _count(cases: list[dict[str, Any]], outcome: str) -> int:
    return sum(1 for c in cases if c["outcome"] == outcome)


def run(opts: Any) -> list[Figure]:
    quick = bool(getattr(opts, "quick", False))
    tmp = tempfile.mkdtemp(prefix="glrel")
    log, fuzz = os.path.join(tmp, "faults.jsonl"), os.path.join(tmp, "fuzz.json")
    examples = "10" if quick else os.environ.get("GPULEASE_FUZZ_EXAMPLES", "100")
    attack_log = os.path.join(tmp, "attacks.jsonl")
    env = {"GPULEASE_RELIABILITY_LOG": log, "GPULEASE_FUZZ_STATS": fuzz, "GPULEASE_FUZZ_EXAMPLES": examples,
           "GPULEASE_ATTACK_LOG": attack_log}
    faults = _pytest(["tests/broker/service/test_faults.py"], env, os.path.join(tmp, "f.xml"))
    security = _pytest(["-m", "attack", "tests"], env, os.path.join(tmp, "s.xml"))
    brokers = ([json.loads(line) for line in Path(attack_log).read_text().splitlines()]
               if os.path.exists(attack_log) else [])
    fuzzed = _pytest(["tests/test_openapi.py::test_generated_requests_get_documented_answers"], env,
                     os.path.join(tmp, "z.xml"))
    records = [json.loads(line) for line in Path(log).read_text().splitlines()] if os.path.exists(log) else []
    fz = json.loads(Path(fuzz).read_text()) if os.path.exists(fuzz) else {}

    figures: list[Figure] = []
    fc = faults["cases"]
    lost = sum(int(r.get("leases_lost", 0)) + max(0, int(r.get("leases_before", 0)) - int(r.get("leases_after", r.get(
        "leases_after_restore", r.get("leases_before", 0))))) for r in records)
    doubles = sum(int(r.get("double_grants", 0)) for r in records)
    lines = []
    for r in records:
        rest = ", ".join(f"{k} {v}" for k, v in r.items() if k != "fault")
        lines.append(f"{r['fault']}: {rest}")
    figures.append(figure(
        "fault tests survived", "tests", [float(_count(fc, "passed"))], "fault tests run", [float(len(fc))],
        bar=("min", ">=", float(len(fc) - _count(fc, "skipped"))) if fc else ("min", ">=", 1.0),
        note="real broker, kernels and processes (tests/broker/service/test_faults.py): " + "; ".join(lines)
             + (f". Failed: {[c['name'] for c in fc if c['outcome'] == 'failed']}" if _count(fc, "failed") else "")))
    figures.append(figure(
        "leases lost or granted twice across the faults", "leases", [float(lost + doubles)], "none", [],
        bar=("max", "<=", 0.0),
        note=f"summed over the recorded faults: {lost} lost, {doubles} GPUs granted twice"))
    kk = [r for r in records if r["fault"].startswith("kernel kill")]
    if kk:
        figures.append(figure(
            "kernel kill -9 mid-cell: its worker gone", "s", [float(r["worker_gone_s"]) for r in kk],
            "the lease ended (heartbeat timeout 2 s)", [float(r["lease_ended_s"]) for r in kk],
            bar=("max", "<=", 1.0), note="from SIGKILL of the kernel to its worker's exit; the baseline column "
                                         "is when the broker ended its lease"))
    crashes = [r for r in records if r["fault"].startswith("worker dies")]
    if crashes:
        figures.append(figure(
            "worker crash: lease released after the cell's error", "s",
            [float(r["lease_released_s_after_cell"]) for r in crashes], "none", [], bar=("max", "<=", 1.0),
            note="; ".join(f"{r['fault'][13:]} → {r['error']}" for r in crashes)
                 + " (the error shows the exit status or signal and the tail of stderr)"))
    sc = security["cases"]
    figures.append(figure(
        "attacks that failed (security and bad-input tests passed)", "tests", [float(_count(sc, "passed"))],
        "attacks tried", [float(len(sc))],
        bar=("min", ">=", float(len(sc) - _count(sc, "skipped"))) if sc else ("min", ">=", 1.0),
        note="every test marked `attack` (pytest -m attack): another local user against parked sessions, transfer "
             "buffers and artifacts (an inotify race), a squatted socket and a server of another uid, a Hub user "
             "named like a Unix user or admin, revoked, expired and random Hub tokens, an admin removed from a group, "
             "a connection flood and a queue flood, two brokers on one store, wall-clock steps, NaN/Infinity/huge "
             "numbers/surrogates in the policy and in bodies, damaged stores and socket paths, a second Unix user "
             f"against leases, admins, file modes, secrets in logs, recycled pids; skipped: {_count(sc, 'skipped')}"
             + (f". Failed: {[c['name'] for c in sc if c['outcome'] == 'failed']}" if _count(sc, "failed") else "")))
    figures.append(figure(
        "attacks: 5xx answers, broker tracebacks and crashes", "count",
        [float(sum(b["answers_5xx"] + b["tracebacks"] + b["crashed"] for b in brokers))], "none", [],
        bar=("max", "<=", 0.0),
        note=f"over the {len(brokers)} real broker processes the attack tests started: "
             f"{sum(b['answers_5xx'] for b in brokers)} answers 5xx other than 503, "
             f"{sum(b['tracebacks'] for b in brokers)} tracebacks logged, {sum(b['crashed'] for b in brokers)} "
             f"brokers that died by themselves; {sum(b.get('answers_503', 0) for b in brokers)} answers 503, each "
             "the designed answer while the Hub or the store is away ("
             + ", ".join(sorted({b['test'].split('::')[-1] for b in brokers if b.get('answers_503')})) + ")"))
    fuzz_ok = fuzzed["returncode"] == 0
    figures.append(figure(
        "fuzzer inputs (schemathesis, from the OpenAPI document)", "requests", [float(fz.get("inputs", 0))],
        "none", [], bar=("min", ">=", 1.0),
        note=f"{fz.get('operations', 0)} operations, valid and invalid inputs, {examples} examples per operation "
             f"and mode; answers by status {fz.get('statuses', {})}; no 5xx and every answer matching the "
             f"document: {'yes' if fuzz_ok else 'NO — see the test output'}"))
    figures.append(figure(
        "fuzzer: 5xx or undocumented answers", "answers",
        [float(sum(v for k, v in fz.get("statuses", {}).items() if int(k) >= 500) + (0 if fuzz_ok else 1))],
        "none", [], bar=("max", "<=", 0.0)))

    from . import load

    r = load.LAST
    if r is None:
        r = load.run_load(load.LoadConfig(clients=100 if quick else 1000, seconds=5 if quick else 10,
                                          gpus=64 if quick else 512, nodes=8 if quick else 64))
    bad = (len(r.errors) + len(r.client_double_grants) + len(r.store_double_grants) + len(r.lost)
           + len(r.broker_log_errors))
    figures.append(figure(
        f"load held: {r.config['clients']} clients for {r.config['seconds']:g} s, grants", "grants",
        [float(r.granted)], "requests", [float(r.requests)],
        note=f"{r.requests:,} requests, {r.granted:,} grants, {r.released:,} releases, {r.cancelled} cancelled at "
             f"the deadline; {len(r.errors)} errors, {len(r.client_double_grants) + len(r.store_double_grants)} "
             f"double grants, {len(r.lost)} leases lost (see the Load and soak section)"))
    figures.append(figure("load: errors + double grants + leases lost", "count", [float(bad)], "none", [],
                          bar=("max", "<=", 0.0)))
    for name, res in (("faults", faults), ("security", security), ("fuzz", fuzzed)):
        if res["returncode"] not in (0, 5):
            print(f"{name} tests failed:\n{res['tail']}", flush=True)
    return figures

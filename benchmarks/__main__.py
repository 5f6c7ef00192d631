"""``python -m benchmarks [--quick] [--only NAME ...] [--output BENCHMARKS.md] [--json FILE]``."""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from . import MODULES, SOAK
from .report import machine, now, rewrite, section, table

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: proves the harness works (seconds)")
    parser.add_argument("--only", action="append", choices=MODULES, help="run only this module (repeatable); without it, every module but the soak ones "
                        f"({', '.join(SOAK)}: make soak)")
    parser.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"), help="the report to rewrite")
    parser.add_argument("--json", default="", help="also write every figure as JSON to this file")
    opts = parser.parse_args(argv)
    command = "python -m benchmarks" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])).rstrip()
    mach, when = machine(), now()
    compile_bytecode()
    results: dict[str, Any] = {}
    new: dict[str, str] = {}
    failed = 0
    for name in opts.only or [m for m in MODULES if m not in SOAK]:
        mod = importlib.import_module(f"benchmarks.{name}")
        print(f"== {name}: {mod.TITLE}", flush=True)
        started = time.monotonic()
        figures = mod.run(opts)
        print(table(figures))
        print(f"({time.monotonic() - started:.0f} s)\n", flush=True)
        failed += sum(1 for f in figures if f["result"] == "FAIL")
        results[name] = {"title": mod.TITLE, "figures": figures}
        new[name] = section(name, mod.TITLE, figures, command, when, mach, opts.quick)
    rewrite(Path(opts.output), new, MODULES)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"machine": mach, "date": when, "command": command,
                                               "quick": opts.quick, "modules": results}, indent=2))
    print(f"Wrote {opts.output}; {failed} figure(s) miss their bar" if failed else f"Wrote {opts.output}")
    return 0  # a missed bar is a result, reported in the file, not a crash


def compile_bytecode() -> None:
    """Compile the project's modules to bytecode first, as ``pip install`` does. A checkout run with
    PYTHONDONTWRITEBYTECODE=1 (this machine's default) would otherwise compile every module again at every
    broker or worker start, which is not what a deployment pays."""
    import compileall

    for package in ("lease_broker", "jupyter_gpulease"):
        compileall.compile_dir(str(ROOT / package), quiet=1)


if __name__ == "__main__":
    sys.exit(main())

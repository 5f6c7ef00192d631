"""What a ``%%gpu`` line asks for: its options, read into the broker request and the cell's own settings."""

from __future__ import annotations

import os
import re
from typing import Any

from IPython.core.error import UsageError

from gpulease_protocol.requests import parse_duration, request_fields

#: options whose value may look like a negative number (``--time -5m``): argparse would take it for an option
VALUE_OPTIONS = ("--time", "--idle", "--mem", "--gpu-mem", "--wait", "--grace")
_NEGATIVE = re.compile(r"(?<!\S)(" + "|".join(VALUE_OPTIONS) + r")\s+(-[\d.]\S*)")


def negative_values(line: str) -> str:
    """``--time -5m`` as ``--time=-5m``, so a negative value gets the option's own clear error."""
    return _NEGATIVE.sub(r"\1=\2", line)


def names(text: str) -> list[str]:
    """The variable names of ``--in``/``--out`` (comma-separated); ``ValueError`` for one that is not a name."""
    found = [n.strip() for n in (text or "").split(",") if n.strip()]
    for n in found:
        if not n.isidentifier():
            raise ValueError(f"invalid variable name {n!r}")
    return found


def cell_options(args: Any, cell_name: str, default_grace: float) -> dict[str, Any]:
    """The parsed ``%%gpu`` arguments as {request (the broker's body), wait, grace, gpus}; ``UsageError`` naming
    the option that is wrong."""
    try:
        request = request_fields(args.gpus, mem=args.mem, time=args.time, idle=args.idle, gpu_type=args.gpu_type,
                                 gpu_mem=args.gpu_mem, flag="--")
        request["heartbeat"] = True
        if args.priority:
            request["priority"] = args.priority
        wait = parse_duration(args.wait, "--wait") if args.wait else None
        grace = parse_duration(args.grace, "--grace") if args.grace else default_grace
        for flag in ("session", "bg"):
            name = getattr(args, flag)
            if name is not None and not name.replace("-", "_").isidentifier():
                raise ValueError(f"invalid --{flag} name {name!r}: use letters, digits, - and _")
        names(args.out)
        if args.inputs.strip() != "auto":
            names(args.inputs)
    except ValueError as e:
        raise UsageError(f"%%gpu: {e}") from None
    if args.session and args.bg:
        raise UsageError("%%gpu: --session and --bg cannot be combined")
    labels = {"source": "%%gpu", "cell": cell_name.strip("<>")}
    if args.bg:
        labels["bg"] = args.bg  # the broker tells its owner when it ends (gpulease notify: bg)
    if os.environ.get("JPY_SESSION_NAME"):
        labels["notebook"] = os.environ["JPY_SESSION_NAME"][-200:]
    if args.session:
        labels["session"] = args.session  # the sidebar says what releasing would stop
    request["labels"] = labels
    return {"request": request, "wait": wait, "grace": grace, "gpus": args.gpus}

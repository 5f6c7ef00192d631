"""Regenerate the reference blocks of docs/*.md from the code (magic arguments, traitlets help).

    .venv/bin/python scripts/gen_docs.py          # rewrite the blocks
    .venv/bin/python scripts/gen_docs.py --check  # exit 1 if a block is stale (the tests run this)

A block sits between ``<!-- BEGIN GENERATED: NAME -->`` and ``<!-- END GENERATED: NAME -->``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal: make the output the same everywhere

DOCS = Path(__file__).resolve().parent.parent / "docs"


def magic_usage() -> str:
    from jupyter_gpulease.kernel.magics import GpuMagics

    doc = GpuMagics.gpu.__doc__ or ""
    return "```text\n" + "\n".join(line.rstrip() for line in doc.strip("\n").splitlines()) + "\n```"


def traits_table(cls: Any) -> str:
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for name, trait in sorted(cls.class_traits(config=True).items()):
        default = trait.default_value_repr() if hasattr(trait, "default_value_repr") else repr(trait.default_value)
        help_text = " ".join((trait.help or "").split()).replace("|", "\\|")
        rows.append(f"| `{cls.__name__}.{name}` | `{default}` | {help_text} |")
    return "\n".join(rows)


def blocks() -> dict[str, str]:
    from jupyter_gpulease.kernel.magics import GpuMagics

    out = {"magic-usage": magic_usage(), "magic-options": traits_table(GpuMagics)}
    try:
        from lease_broker.api.hub import HubIdentity
        from lease_broker.app import LeaseBroker
        from lease_broker.notify.notifier import Notifier
        from lease_broker.policy.lease_policy import LeasePolicy

        out["policy-options"] = traits_table(LeasePolicy)
        out["broker-options"] = traits_table(LeaseBroker)
        out["notifier-options"] = traits_table(Notifier)
        out["hub-options"] = traits_table(HubIdentity)
    except ImportError:
        pass
    return out


def render(text: str, generated: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        body = generated.get(name, m.group(2).strip("\n"))
        return f"<!-- BEGIN GENERATED: {name} -->\n{body}\n<!-- END GENERATED: {name} -->"

    return re.sub(r"<!-- BEGIN GENERATED: ([\w-]+) -->\n(.*?)<!-- END GENERATED: \1 -->", sub, text, flags=re.S)


def main(argv: list[str]) -> int:
    generated = blocks()
    stale = []
    for path in sorted(DOCS.glob("*.md")):
        old = path.read_text()
        new = render(old, generated)
        if new != old:
            stale.append(path.name)
            if "--check" not in argv:
                path.write_text(new)
    if stale and "--check" in argv:
        print("stale generated blocks in: " + ", ".join(stale) + " (run: .venv/bin/python scripts/gen_docs.py)")
        return 1
    print("updated: " + (", ".join(stale) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``%%gpu --bg NAME``: a cell that runs on a thread of the kernel while the notebook goes on; its output keeps
arriving in the cell that started it, ``--out`` names are assigned when it succeeds, and ``%gpu jobs`` lists the
jobs."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError

from .cellrun import Outcome, summary_line


@dataclass
class BackgroundJob:
    name: str
    state: str = "queued"  # queued | running | done | failed
    started: float = 0.0
    lease_id: str | None = None
    error: str | None = None


class BackgroundJobs:
    def __init__(self) -> None:
        self.by_name: dict[str, BackgroundJob] = {}

    def values(self) -> list[BackgroundJob]:
        return list(self.by_name.values())

    def start(self, name: str, shell: Any, run: Callable[[Callable[[str], None]], Outcome], show_summary: bool) -> None:
        """Run ``run(granted)`` (the cell on its lease) on a thread, its output in the current cell; ``run`` calls
        ``granted(lease_id)`` once it holds its lease (``%gpu jobs`` shows it while the job runs)."""
        old = self.by_name.get(name)
        if old is not None and old.state in ("queued", "running"):
            raise UsageError(f"%%gpu: a background job named {name!r} is still {old.state}")
        parent = shell.get_parent() if hasattr(shell, "get_parent") else None
        entry = self.by_name[name] = BackgroundJob(name, started=time.time())

        def work() -> None:
            tokens = shell.set_thread_parent(parent) if parent is not None else None
            try:
                entry.state = "running"
                outcome = run(lambda lease_id: setattr(entry, "lease_id", lease_id))
                shell.user_ns.update(outcome.outputs)
                entry.lease_id, entry.state = outcome.lease.id, "done"
                if show_summary:
                    print(f"[{name}] " + summary_line(outcome), flush=True)
                if outcome.value is not None:
                    from IPython.display import display

                    display(outcome.value)
            except BaseException as e:  # report in the launching cell; never kill the kernel's thread silently
                entry.state, entry.error = "failed", str(e)
                if show_summary and getattr(e, "outcome", None) is not None:
                    print(f"[{name}] " + summary_line(e.outcome, failed=e.ename,  # type: ignore[attr-defined]
                                                      not_back=getattr(e, "code_ok", False)), flush=True)
                text = e._render_traceback_() if hasattr(e, "_render_traceback_") else [f"{type(e).__name__}: {e}"]
                print(f"[{name}] failed:\n" + "\n".join(text), file=sys.stderr, flush=True)
            finally:
                if tokens is not None:
                    shell.reset_thread_parent(tokens)

        threading.Thread(target=work, name=f"gpulease-bg-{name}", daemon=True).start()
        print(f"gpulease: {name!r} runs in the background; its output appears in this cell. `%gpu jobs` lists jobs.")

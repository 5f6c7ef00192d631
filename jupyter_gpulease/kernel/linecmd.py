"""The ``%gpu`` line magic's commands: status, leases, queue, quota, release, sessions, artifacts, jobs, notify."""

from __future__ import annotations

import time
from typing import Any

from IPython.core.error import UsageError

from gpulease_protocol.words import duration_text

from .. import artifacts
from ..client import BrokerError, BrokerUnreachable
from ..notify import notify, notify_text
from ..tables import leases_table, queue_table, quota_table, status_text, suspended_lines, table
from .acquire import gpu_error

LINE_COMMANDS = """
Line magic: %gpu status | leases [N] | queue | quota | release ID | sessions
            | session stop|park|suspend|resume NAME
            | artifacts [N] | jobs | notify [show | on | off | KIND[,KIND]]
"""


def line_command(magics: Any, line: str) -> Any:
    """``%gpu CMD ...``: status, leases, queue, quota, release, sessions, artifacts, jobs, notify."""
    words = line.split()
    cmd, rest = (words[0], words[1:]) if words else ("status", [])
    try:
        if cmd == "status":
            print(status_text(magics.client.url, magics.client.status()))
            suspended = suspended_lines(magics.client.leases())  # the broker's words: since when, why, resumes how
            if suspended:
                print("\n" + suspended)
        elif cmd == "leases":
            leases = magics.client.leases(ended=int(rest[0]) if rest else 0)
            print(leases_table(leases) if leases else "No leases." + ("" if rest else " (`%gpu leases 10` also "
                                                                       "lists the last 10 ended ones)"))
        elif cmd == "queue":
            q = magics.client.queue()
            print(queue_table(q) if q else "The queue is empty.")
        elif cmd == "quota":  # what is left of each limit and budget that applies to me, and when it refills
            print(quota_table(magics.client.quota()))
        elif cmd == "release" and rest:
            for lease_id in rest:
                magics.client.release(lease_id, "released with the line magic gpu release")
                print(f"released {lease_id}")
        elif cmd == "sessions":
            rows = magics.sessions.rows()
            print(table(["SESSION", "LEASE", "STATE", "CELLS", "AGE"], rows) if rows else "No sessions.")
        elif cmd == "session" and len(rest) == 2 and rest[0] == "stop":
            s = magics.sessions.stop(rest[1])
            print(f"session {s.name!r} stopped; lease {s.lease_id} released")
        elif cmd == "session" and len(rest) == 2 and rest[0] == "park":
            s = magics.sessions.park(rest[1])
            print(f"session {s.name!r} parked {s.parked_where()} ({s.describe_parked()}); lease {s.lease_id} released. "
                  "Its next cell gets a GPU and its variables again.")
        elif cmd == "session" and len(rest) == 2 and rest[0] == "suspend":
            s = magics.sessions.suspend(rest[1])
            print(f"session {s.name!r}: " + s.suspended_text() + ". Its next cell (or `%gpu session resume "
                  f"{s.name}`) gets a GPU and resumes it with every variable intact.")
        elif cmd == "session" and len(rest) == 2 and rest[0] == "resume":
            s = magics.sessions.resume(rest[1])
            print(f"session {s.name!r} resumed on lease {s.lease_id}, every variable intact")
        elif cmd == "artifacts":
            return _recent_artifacts(magics, int(rest[0]) if rest else 10)
        elif cmd == "notify":
            print(notify_text(notify(magics.client, rest)))
        elif cmd == "jobs":
            rows = [[j.name, j.state, j.lease_id or "-", duration_text(time.time() - j.started), j.error or ""]
                    for j in magics.jobs.values()]
            print(table(["JOB", "STATE", "LEASE", "AGE", "ERROR"], rows) if rows else "No background jobs.")
        else:
            raise UsageError(f"%gpu: unknown command {line.strip()!r}.{LINE_COMMANDS}")
    except BrokerUnreachable as e:  # not a mistake in the command: one line of its own
        raise gpu_error("BrokerUnreachable", f"%gpu {cmd}: {e}") from None
    except (BrokerError, KeyError, ValueError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else e  # a KeyError's str() is quoted
        raise UsageError(f"%gpu {cmd}: {why}") from None
    return None

def _recent_artifacts(magics: Any, limit: int) -> None:
    items = artifacts.recent(magics._root(), limit)
    if not items:
        print(f"No artifacts under {magics._root()} yet.")
        return
    rows = [[a.lease_id, a.meta.get("status"), a.meta.get("started_at", "")[:19],
             duration_text(a.meta.get("wall_seconds") or 0), a.url] for a in items]
    print(table(["LEASE", "STATUS", "STARTED", "WALL", "WHERE"], rows))
    print("Load one with jupyter_gpulease.artifacts.load(LEASE_ID)")

"""Leases: request, look up, wait, release, renew, heartbeat, attach processes, revoke, suspended (the holder's
report) and resume, history."""

from __future__ import annotations

from tornado import web

from gpulease_protocol.requests import quoted

from ..core.errors import BadRequest
from ..core.lease import LeaseState, parse_duration
from .base import LEASE_ID, MAX_WAIT, BaseHandler, Routes


class LeasesHandler(BaseHandler):
    async def get(self) -> None:
        everyone = self.get_query_argument("all", "0") in ("1", "true", "yes")
        try:
            ended = int(self.get_query_argument("ended", "0"))
        except ValueError:
            raise BadRequest(f"Invalid ended={quoted(self.get_query_argument('ended'))}: give a count") from None
        leases = self.manager.list_leases(self.who, everyone=everyone, include_ended=max(0, min(ended, 1000)))
        await self.reply({"leases": [self.view(lease) for lease in leases]})

    async def post(self) -> None:
        body = self.body()
        wait = parse_duration(body.pop("wait_seconds", 0), "wait_seconds")
        lease, secret = self.manager.request(self.who, body)
        await self.manager.settled()  # the pass it queued runs first (one pass for all requests of the iteration)
        if wait and lease.state == LeaseState.QUEUED:
            lease = await self.manager.wait(lease, min(wait, MAX_WAIT))
        view = self.view(lease)
        view["secret"] = secret
        await self.reply(view, 202 if lease.state == LeaseState.QUEUED else 201)


class LeaseHandler(BaseHandler):
    async def get(self, lease_id: str) -> None:
        lease = self.manager.lookup(lease_id, self.who)
        wait = self.query_float("wait", 0.0)
        if wait and lease.state == LeaseState.QUEUED:
            lease = await self.manager.wait(lease, min(wait, MAX_WAIT))
        await self.reply(self.view(lease))

    async def delete(self, lease_id: str) -> None:
        reason = self.get_query_argument("reason", "released")
        lease = self.manager.release(lease_id, self.who, reason)
        await self.reply(self.view(lease))


class LeaseActionHandler(BaseHandler):
    async def post(self, lease_id: str, action: str) -> None:
        m = self.manager
        body = self.body()
        if action == "release":
            lease = m.release(lease_id, self.who, str(body.get("reason", "released")))
        elif action == "renew":
            lease = m.renew(lease_id, self.who, body.get("duration_seconds"), body.get("extend_seconds"))
        elif action == "heartbeat":
            active = body.get("active", False)
            if not isinstance(active, bool):
                raise BadRequest(f"Invalid active {active!r}: must be true or false")
            lease = m.heartbeat(lease_id, self.who, active)
        elif action == "processes":
            lease = m.attach(lease_id, self.who, body.get("pid"))
        elif action == "revoke":
            lease = m.revoke(lease_id, self.who, str(body.get("reason", "admin")))
        elif action == "suspended":
            lease = m.suspended(lease_id, self.who, body)
        elif action == "resume":
            wait = parse_duration(body.get("wait_seconds", 0), "wait_seconds")
            lease = m.resume(lease_id, self.who)
            await m.settled()  # the pass it asked for runs first
            if wait and lease.state == LeaseState.SUSPENDED:
                lease = await m.wait(lease, min(wait, MAX_WAIT))
        else:  # pragma: no cover - the route only matches known actions
            raise web.HTTPError(404)
        await self.reply(self.view(lease))


class HistoryHandler(BaseHandler):
    async def get(self, lease_id: str) -> None:
        lease, transitions = self.manager.history(lease_id, self.who)
        await self.reply({"lease_id": lease_id, "transitions": transitions, "usage": self.view(lease)["usage"]})


def routes(prefix: str) -> Routes:
    return [
        (prefix + r"/leases", LeasesHandler),
        (prefix + r"/leases/" + LEASE_ID, LeaseHandler),
        (prefix + r"/leases/" + LEASE_ID + r"/(release|renew|heartbeat|processes|revoke|suspended|resume)", LeaseActionHandler),
        (prefix + r"/leases/" + LEASE_ID + r"/history", HistoryHandler),
    ]

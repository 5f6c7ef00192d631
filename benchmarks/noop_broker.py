"""The broker with one extra endpoint that does no lease work, for the HTTP floor of a grant+release pair.

``POST /api/v1/noop`` and ``POST /api/v1/noop/ID/release`` go through the same handler base as the lease
endpoints (the JSON body, the caller's identity, waiting for the iteration to settle, a JSON answer of a
lease's size) and change nothing. Two of them cost what a grant+release pair costs in HTTP alone; the rest of a
pair is the lease work. Run as ``python -m benchmarks.noop_broker`` with the broker's arguments (benchmarks only:
the broker never serves this endpoint).
"""

from __future__ import annotations

from typing import Any

from lease_broker import service
from lease_broker.api.base import BaseHandler, Routes
from lease_broker.api.routes import PREFIX, default_handlers
from lease_broker.app import main

#: An answer of about the size of a lease's view.
ANSWER = {"id": "l-000000000000", "state": "granted", "reason": "granted", "devices": [{"id": "GPU-0", "index": 0}],
          "labels": {}, "env": {"CUDA_VISIBLE_DEVICES": "GPU-0"}, "secret": "x" * 32}


class NoopHandler(BaseHandler):
    async def post(self, *_: Any) -> None:
        self.body()
        await self.manager.settled()
        await self.reply(ANSWER, 201)


def handlers(prefix: str = PREFIX) -> Routes:
    return [(prefix + r"/noop(?:/[A-Za-z0-9_-]+/release)?", NoopHandler), *default_handlers(prefix)]


if __name__ == "__main__":
    service.default_handlers = handlers  # type: ignore[attr-defined]  # make_app serves the no-op endpoint too
    main()

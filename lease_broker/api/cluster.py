"""The cluster as a caller sees it: broker info, the GPUs, the queue, and the API's own description."""

from __future__ import annotations

from .base import BaseHandler, Routes
from .openapi import load


class InfoHandler(BaseHandler):
    async def get(self) -> None:
        m = self.manager
        await self.reply(
            {
                **self.info,
                "inventory": m.inventory.describe(),
                "simulated": m.inventory.simulated,
                "user": {"name": self.who.user, "uid": self.who.uid, "admin": self.who.admin},
                "time": m.clock.now(),
                "summary": m.summary(),
                "policy": {
                    "default_duration_seconds": m.policy.default_duration_seconds,
                    "max_duration_seconds": m.policy.max_duration_seconds,
                    "default_idle_timeout_seconds": m.policy.default_idle_timeout_seconds,
                    "heartbeat_timeout": m.policy.heartbeat_timeout,
                    "priority_classes": dict(m.policy.priority_classes),
                    "max_gpus_per_user": m.policy.user_cap(self.who.user),
                },
            }
        )


class GpusHandler(BaseHandler):
    async def get(self) -> None:
        m = self.manager
        await self.reply({"simulated": m.inventory.simulated, "summary": m.summary(), "gpus": m.gpu_views(self.who)})


class QueueHandler(BaseHandler):
    async def get(self) -> None:
        await self.reply({"queue": self.manager.queue_view(self.who)})


class OpenAPIHandler(BaseHandler):
    def prepare(self) -> None:  # the API description is public
        pass

    async def get(self) -> None:
        await self.reply(load())


def routes(prefix: str) -> Routes:
    return [
        (prefix + r"/info", InfoHandler),
        (prefix + r"/gpus", GpusHandler),
        (prefix + r"/queue", QueueHandler),
        (prefix + r"/openapi.json", OpenAPIHandler),
    ]

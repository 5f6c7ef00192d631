"""Real receivers for the notification tests: a tornado webhook server and an aiosmtpd SMTP server, each in a
thread of its own, recording what they were sent."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from email import message_from_bytes
from typing import Any

from aiosmtpd.controller import Controller
from tornado import httpserver, netutil, web


class WebhookReceiver:
    """POST /hook: answers as ``mode`` says: "ok" (204), "fail" (500) or "hang" (never, until stopped)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.attempts = 0
        self.mode = "ok"
        self._hanging: list[asyncio.Future[None]] = []
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook/secret-path"

    def _run(self, ready: threading.Event) -> None:
        outer = self

        class Hook(web.RequestHandler):
            async def post(self, _: str) -> None:
                outer.attempts += 1
                if outer.mode == "hang":
                    fut = asyncio.get_running_loop().create_future()
                    outer._hanging.append(fut)
                    await fut
                    return
                if outer.mode == "fail":
                    self.set_status(500)
                    return
                outer.received.append(json.loads(self.request.body))
                self.set_status(204)

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        socks = netutil.bind_sockets(0, "127.0.0.1")
        self.port = socks[0].getsockname()[1]
        server = httpserver.HTTPServer(web.Application([(r"/hook/(.*)", Hook)]))
        server.add_sockets(socks)
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        def end() -> None:
            for f in self._hanging:
                if not f.done():
                    f.set_result(None)
            self.loop.stop()

        self.loop.call_soon_threadsafe(end)
        self.thread.join(10)


class SmtpReceiver:
    def __init__(self) -> None:
        self.mails: list[Any] = []
        outer = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
                outer.mails.append((envelope.rcpt_tos, message_from_bytes(envelope.content)))
                return "250 OK"

        with socket.socket() as s:  # a free port (the controller checks the one it is given by connecting)
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self.controller.start()

    def stop(self) -> None:
        self.controller.stop()

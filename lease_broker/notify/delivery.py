"""Sending one message: a webhook POST (Slack/Mattermost-compatible JSON) or an e-mail over SMTP.

Both run off the event loop's critical path: the webhook with tornado's asynchronous HTTP client and a timeout,
the mail in a thread (smtplib blocks). Errors are returned as short descriptions that never hold a secret (no
URL path or query, no password).
"""

from __future__ import annotations

import asyncio
import json
import smtplib
import ssl
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any
from urllib.parse import urlsplit

from tornado.httpclient import AsyncHTTPClient, HTTPRequest


def safe_target(target: str) -> str:
    """What a log line may say about a receiver: a webhook's scheme and host (its path is often the secret)."""
    if "://" in target:
        parts = urlsplit(target)
        return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return target


async def post_webhook(url: str, body: dict[str, Any], timeout: float) -> str | None:
    """POST ``body`` as JSON; None on a 2xx answer, else what went wrong."""
    req = HTTPRequest(url, method="POST", body=json.dumps(body), headers={"Content-Type": "application/json"},
                      connect_timeout=timeout, request_timeout=timeout, follow_redirects=False)
    try:
        resp = await AsyncHTTPClient().fetch(req, raise_error=False)
    except Exception as e:  # connection refused, DNS, TLS
        return f"{type(e).__name__}: {e}".replace(url, safe_target(url))
    if 200 <= resp.code < 300:
        return None
    return f"HTTP {resp.code}" if resp.code != 599 else f"no answer within {timeout:g} s"


@dataclass(frozen=True)
class Smtp:
    host: str
    port: int
    sender: str
    username: str = ""
    password: str = ""
    starttls: bool = False
    timeout: float = 10.0

    async def send(self, to: str, subject: str, text: str) -> str | None:
        """Send one mail (in a thread); None when the server accepted it, else what went wrong."""
        msg = EmailMessage()
        msg["From"], msg["To"], msg["Subject"] = self.sender, to, subject
        msg.set_content(text)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._send, msg)
        except (OSError, smtplib.SMTPException) as e:
            return f"{type(e).__name__}: {e}".replace(self.password, "***") if self.password else \
                f"{type(e).__name__}: {e}"
        return None

    def _send(self, msg: EmailMessage) -> None:
        with smtplib.SMTP(self.host, self.port, timeout=self.timeout) as s:
            if self.starttls:
                s.starttls(context=ssl.create_default_context())
            if self.username:
                s.login(self.username, self.password)
            s.send_message(msg)

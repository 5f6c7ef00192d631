"""Notifications for when JupyterLab is closed: webhooks and e-mail from the broker's event stream.

The notifier listens on the event bus like any other subscriber (so it sees only stored changes: events go out
after the group commit). For each event it asks :func:`messages.message` what the lease's owner should be told,
checks the kinds the owner chose (``gpulease notify``), and stores one outbox row per receiver: the user's
webhook, their groups' webhooks (``@group`` keys) and their e-mail address. A sender task delivers due rows, a few
at a time, with retries and exponential backoff. Nothing here runs inside a request: a slow or failing receiver
delays only its own messages. A restarted broker resumes the pending rows and never sends a sent one again; an
event the broker published but had not yet stored in the outbox when it was killed is not sent (at most once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from traitlets import Bool, Dict, Float, Integer, List, Unicode
from traitlets.config import LoggingConfigurable

from ..store.notify_store import NotifyStore, Outgoing
from .delivery import Smtp, post_webhook, safe_target
from .messages import KINDS, message

log = logging.getLogger("lease_broker")


class Notifier(LoggingConfigurable):
    webhooks = Dict(
        key_trait=Unicode(), value_trait=Unicode(), config=True,
        help="Webhook URL per user, or per group with an '@' key (Slack- and Mattermost-compatible: the JSON body "
        "has 'text'). Example: {'alice': 'https://hooks.slack.com/services/…', '@ml': 'https://chat.example/hooks/x'}. "
        "The URLs are secrets: the broker logs only their host.",
    )
    emails = Dict(key_trait=Unicode(), value_trait=Unicode(), config=True,
                  help="E-mail address per user (sent through smtp_host). Example: {'alice': 'alice@example.org'}.")
    smtp_host = Unicode("", config=True, help="SMTP server for e-mail notifications; '' = no e-mail.")
    smtp_port = Integer(25, config=True, help="SMTP port, e.g. 25, or 587 with smtp_starttls.")
    smtp_from = Unicode("gpulease@localhost", config=True, help="Sender address of notification mails.")
    smtp_username = Unicode("", config=True, help="SMTP login ('' = none).")
    smtp_password = Unicode("", config=True, help="SMTP password (never logged). Prefer a config file readable "
                            "only by the broker's user.")
    smtp_starttls = Bool(False, config=True, help="Upgrade the SMTP connection with STARTTLS.")
    default_events = List(Unicode(), list(KINDS), config=True,
                          help=f"Kinds a user is told about until they choose with 'gpulease notify': any of "
                          f"{', '.join(KINDS)}.")
    retries = Integer(6, config=True, help="Attempts per message before it is given up (logged, counted).")
    backoff_seconds = Float(5.0, config=True, help="Wait before the first retry; doubles each time. Example: 5.")
    timeout_seconds = Float(10.0, config=True, help="Seconds a receiver may take to accept one message.")
    concurrency = Integer(4, config=True, help="Messages delivered at once.")

    def __init__(self, store: NotifyStore, subscribe: Callable[[], asyncio.Queue[dict[str, Any]]],
                 groups_of: Callable[[str], tuple[str, ...]], clock: Callable[[], float] = time.time,
                 email_of: Callable[[str], Awaitable[str | None]] | None = None, **kwargs: Any) -> None:
        """``email_of``: where to find a user's address that ``emails`` does not give (JupyterHub's user model)."""
        super().__init__(**kwargs)
        self.store, self._subscribe, self.groups_of, self.clock = store, subscribe, groups_of, clock
        self.email_of = email_of
        self.counts: dict[tuple[str, str], int] = {}  # (channel, "sent" | "retried" | "failed") -> messages
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def enabled(self) -> bool:
        return bool(self.webhooks or (self.smtp_host and (self.emails or self.email_of)))

    # ------------------------------------------------------------------ what each user chose
    def events_of(self, user: str) -> list[str]:
        chosen = self.store.prefs(user)
        return list(self.default_events) if chosen is None else chosen

    def choose(self, user: str, events: list[str]) -> list[str]:
        unknown = sorted(set(events) - set(KINDS))
        if unknown:
            raise ValueError(f"Unknown notification kind(s) {', '.join(unknown)}: choose from {', '.join(KINDS)}")
        chosen = [k for k in KINDS if k in events]
        self.store.set_prefs(user, chosen)
        return chosen

    def channels_of(self, user: str, address: str | None = None) -> list[tuple[str, str]]:
        """(channel, target) the user's messages go to; ``address``: their e-mail address from elsewhere (the
        Hub), used when ``emails`` has none."""
        out = [("webhook", self.webhooks[user])] if user in self.webhooks else []
        out += [("webhook", self.webhooks["@" + g]) for g in self.groups_of(user) if "@" + g in self.webhooks]
        address = self.emails.get(user) or address
        if self.smtp_host and address:
            out.append(("email", address))
        return list(dict.fromkeys(out))

    # ------------------------------------------------------------------ running
    def start(self) -> None:
        """Listen and send (in the running event loop); does nothing when no receiver is configured."""
        if not self.enabled:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._listen(self._subscribe())), loop.create_task(self._send_loop())]

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()

    async def _listen(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        while True:
            event = await queue.get()
            try:
                user = event.get("user")
                address = None
                if self.smtp_host and self.email_of is not None and isinstance(user, str) and user not in self.emails \
                        and message(event) is not None:
                    address = await self.email_of(user)
                self.take(event, address)
            except Exception:
                log.exception("Notifications: event %s not queued", event.get("seq"))

    def take(self, event: dict[str, Any], address: str | None = None) -> int:
        """Queue the messages an event gives (returns how many are new); ``address``: the owner's e-mail address
        from the Hub."""
        msg = message(event)
        if msg is None or msg.kind not in self.events_of(msg.user):
            return 0
        rows = [(msg.key, channel, target, msg.user, msg.body())
                for channel, target in self.channels_of(msg.user, address)]
        if not rows:
            return 0
        new = self.store.enqueue(rows, self.clock())
        if new:
            self._wake.set()
        return new

    async def _send_loop(self) -> None:
        smtp = Smtp(self.smtp_host, self.smtp_port, self.smtp_from, self.smtp_username, self.smtp_password,
                    self.smtp_starttls, self.timeout_seconds)
        while True:
            due = self.store.due(self.clock(), self.concurrency)
            if due:
                await asyncio.gather(*(self._deliver(m, smtp) for m in due))
                continue
            nxt = self.store.next_due()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), None if nxt is None else max(0.05, nxt - self.clock()))
            except asyncio.TimeoutError:
                pass

    async def _deliver(self, m: Outgoing, smtp: Smtp) -> None:
        if m.channel == "webhook":
            error = await post_webhook(m.target, m.body, self.timeout_seconds)
        else:
            error = await smtp.send(m.target, m.body["subject"], m.body["text"])
        if error is None:
            self.store.sent(m.id)
            self._count(m.channel, "sent")
            return
        attempt = m.attempts + 1
        where = safe_target(m.target)
        if attempt >= self.retries:
            self.store.failed(m.id)
            self._count(m.channel, "failed")
            log.warning("Notification %s to %s (%s) given up after %d attempts: %s", m.key, where, m.channel,
                        attempt, error)
            return
        delay = self.backoff_seconds * 2 ** (attempt - 1)
        self.store.retry(m.id, self.clock() + delay)
        self._count(m.channel, "retried")
        log.info("Notification %s to %s (%s) failed (%s): retry in %.0f s", m.key, where, m.channel, error, delay)

    def _count(self, channel: str, result: str) -> None:
        self.counts[(channel, result)] = self.counts.get((channel, result), 0) + 1

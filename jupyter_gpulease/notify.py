"""``gpulease notify`` and ``%gpu notify``: one reading of the words, one answer text, for both."""

from __future__ import annotations

from typing import Any

from .client import BrokerClient

USAGE = ("notify [show | on | off | KIND[,KIND...]]: what the broker tells you about when JupyterLab is closed "
         "(kinds: granted, warning, ended, bg)")


def notify(client: BrokerClient, words: list[str]) -> dict[str, Any]:
    """Show (no words, ``show``) or choose (``on``: every kind, ``off``: none, else the kinds named) what you are
    told about."""
    if not words or words == ["show"]:
        return client.notify()
    if words == ["on"]:
        return client.notify(client.notify()["kinds"])
    if words == ["off"]:
        return client.notify([])
    return client.notify([k for w in words for k in w.split(",") if k])


def notify_text(answer: dict[str, Any]) -> str:
    events = ", ".join(answer["events"]) or "nothing"
    channels = " and ".join(answer["channels"])
    where = (f"by {channels}" if channels else
             "but no webhook or e-mail address is configured for you: ask your admin (Notifier.webhooks, "
             "Notifier.emails)")
    return f"You are told about: {events} ({where}). Kinds: {', '.join(answer['kinds'])}."

"""Notifications from the broker, for when JupyterLab is closed: real broker processes, a real tornado webhook
receiver, a real SMTP server (aiosmtpd), the real ``gpulease notify`` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_process import scrape_metrics
from receivers import SmtpReceiver, WebhookReceiver
from waiting import wait_for

from lease_broker.notify.messages import message

ME = "root" if os.geteuid() == 0 else os.environ.get("USER", "")


@pytest.fixture
def hook() -> Iterator[WebhookReceiver]:
    r = WebhookReceiver()
    yield r
    r.stop()


@pytest.fixture
def smtp() -> Iterator[SmtpReceiver]:
    r = SmtpReceiver()
    yield r
    r.stop()


def config(tmp_path: Path, hook: WebhookReceiver, smtp: SmtpReceiver | None = None, **extra: object) -> str:
    lines = [f"c.Notifier.webhooks = {{{ME!r}: {hook.url!r}}}", "c.Notifier.backoff_seconds = 0.2",
             "c.Notifier.timeout_seconds = 1"]
    if smtp is not None:
        lines += [f"c.Notifier.emails = {{{ME!r}: 'me@example.org'}}", "c.Notifier.smtp_host = '127.0.0.1'",
                  f"c.Notifier.smtp_port = {smtp.port}"]
    lines += [f"c.Notifier.{k} = {v!r}" for k, v in extra.items()]
    path = tmp_path / "notify_config.py"
    path.write_text("\n".join(lines) + "\n")
    return f"--config={path}"


def _queued_a_second(lease) -> None:
    """Wait until ``lease`` has been queued for a second: a grant after a wait that long is news (one answered at
    once is not), and the broker has no clock a test can drive forward for it."""
    wait_for(lambda: time.time() >= lease.created_at + 1.0, timeout=5, what=f"{lease.id} queued for 1 s")


def test_a_queued_request_granted_is_told_by_webhook_and_mail(broker_factory, tmp_path, hook, smtp) -> None:
    # the first lease sits idle while the second waits: the pressure idle timeout would warn its holder (a
    # notification of its own, see test_pressure_warning_is_told); here only the grant is news
    b = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.pressure_idle_timeout_seconds=0",
                                     config(tmp_path, hook, smtp)])
    c = b.client()
    first = c.request_lease(1, heartbeat=False)
    second = c.request_lease(1, heartbeat=False, labels={"notebook": "train.ipynb", "cell": "3"})
    assert second.state == "queued"
    _queued_a_second(second)
    c.release(first.id)
    wait_for(lambda: hook.received and smtp.mails, timeout=15)
    body = hook.received[0]
    assert body["kind"] == "granted" and body["lease_id"] == second.id and body["user"] == ME
    assert "granted after" in body["text"] and "train.ipynb" in body["text"] and "cell 3" in body["text"]
    (to, mail), = smtp.mails
    assert to == ["me@example.org"] and second.id in mail["Subject"] and "granted" in mail["Subject"]
    assert second.id in mail.get_payload()
    assert len(hook.received) == 1  # the first lease, granted at once, was no news
    sent = ('gpulease_notifications_total{channel="webhook",result="sent"} 1.0',
            'gpulease_notifications_total{channel="email",result="sent"} 1.0')
    # (counted once the receiver answered, which may be just after it recorded the request)
    wait_for(lambda: all(m in scrape_metrics(b.socket) for m in sent), timeout=15)
    assert "secret-path" not in b.log_path.read_text()  # the webhook URL is a secret: never logged


def cli(b, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "--broker", f"unix://{b.socket}", *args],
                          capture_output=True, text=True, timeout=60)


def test_pressure_warning_is_told(broker_factory, tmp_path, hook) -> None:
    """The default policy's pressure idle timeout: when a request waits for the GPU of an idle lease, its holder is
    warned (webhook) once the lease has been idle idle_mark_seconds (1 s here), and the lease is revoked a minute
    after its last activity."""
    b = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.idle_mark_seconds=1", config(tmp_path, hook)])
    c = b.client()
    first = c.request_lease(1, heartbeat=False)
    assert hook.received == []  # no one waits: no warning
    c.request_lease(1, heartbeat=False)
    wait_for(lambda: hook.received, timeout=15)
    body = hook.received[0]
    assert body["kind"] == "warning" and body["lease_id"] == first.id
    assert "idle" in body["text"] and "Use the GPU" in body["text"]
    assert c.lease(first.id).idle_deadline <= first.granted_at + 61


def test_each_user_chooses_what_to_be_told_with_gpulease_notify(broker_factory, tmp_path, hook) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1", config(tmp_path, hook)])
    shown = cli(b, "notify")
    assert shown.returncode == 0 and all(k in shown.stdout for k in ("granted", "warning", "ended", "bg", "webhook"))
    chosen = cli(b, "notify", "ended", "--json")
    assert chosen.returncode == 0 and json.loads(chosen.stdout)["events"] == ["ended"]
    bad = cli(b, "notify", "granted,sometimes")
    assert bad.returncode == 1 and bad.stderr.startswith("gpulease: ") and "sometimes" in bad.stderr \
        and "choose from" in bad.stderr
    c = b.client()
    first = c.request_lease(1, heartbeat=False)
    second = c.request_lease(1, heartbeat=False)
    _queued_a_second(second)  # so that its grant would be news
    c.release(first.id)
    wait_for(lambda: c.lease(second.id).state == "granted", timeout=10)
    c.revoke(second.id, "maintenance")  # not granted (not chosen): ended (chosen)
    third = c.request_lease(1, heartbeat=False)
    c.revoke(third.id, "maintenance")  # a later message: once it is here, so would be any sent before it
    wait_for(lambda: len(hook.received) >= 2, timeout=15)
    assert [(m["kind"], m["lease_id"]) for m in hook.received] == [("ended", second.id), ("ended", third.id)]
    text = hook.received[0]["text"]
    assert "revoked" in text and "admin" in text and "maintenance" in text, text
    assert "nothing" in cli(b, "notify", "off").stdout


def test_a_failing_receiver_is_retried_across_a_restart_and_nothing_is_sent_twice(broker_factory, tmp_path,
                                                                                    hook) -> None:
    hook.mode = "fail"
    b = broker_factory(gpus=1, args=["--tick=0.1", config(tmp_path, hook, retries=50, backoff_seconds=0.5)])
    c = b.client()
    lease = c.request_lease(1, heartbeat=False)
    c.revoke(lease.id, "maintenance")
    wait_for(lambda: hook.attempts >= 2, timeout=15)  # answered 500, retried
    assert 'result="retried"' in scrape_metrics(b.socket)
    b.kill9()
    hook.mode = "ok"
    b.start()  # the pending message is resumed from the outbox
    wait_for(lambda: hook.received, timeout=15)
    b.stop()
    b.start()  # and, once sent, never sent again
    later = b.client().request_lease(1, heartbeat=False)
    b.client().revoke(later.id, "maintenance")  # a later message: once it is here, so would be a resent one
    wait_for(lambda: len(hook.received) >= 2, timeout=15)
    assert [(m["kind"], m["lease_id"]) for m in hook.received] == [("ended", lease.id), ("ended", later.id)]


def test_a_hanging_receiver_does_not_hold_up_grants(broker_factory, tmp_path, hook) -> None:
    hook.mode = "hang"
    b = broker_factory(gpus=2, args=["--tick=0.1", config(tmp_path, hook, concurrency=1)])
    c = b.client()
    for _ in range(10):  # each revoke is a message to the hanging receiver
        lease = c.request_lease(1, heartbeat=False)
        assert lease.state == "granted"
        c.revoke(lease.id, "test")
    wait_for(lambda: 'result="retried"' in scrape_metrics(b.socket), timeout=15)  # timed out, to be retried
    assert c.request_lease(2, heartbeat=False).state == "granted"


@pytest.mark.parametrize("event, kind", [
    ({"type": "lease", "user": "a", "change": "granted", "previous": "queued",
      "lease": {"id": "l-1", "created_at": 0.0, "granted_at": 30.0, "devices": [{"node": "n0", "index": 2}]}},
     "granted"),
    ({"type": "lease", "user": "a", "change": "granted", "previous": "queued",
      "lease": {"id": "l-1", "created_at": 0.0, "granted_at": 0.2}}, None),  # granted at once: no news
    ({"type": "lease", "user": "a", "change": "revoked", "previous": "active",
      "lease": {"id": "l-1", "state": "revoked", "phase": "ended"}}, "ended"),
    ({"type": "lease", "user": "a", "change": "released", "previous": "active",
      "lease": {"id": "l-1", "state": "released", "phase": "ended"}}, None),
    ({"type": "lease", "user": "a", "change": "released", "previous": "active",
      "lease": {"id": "l-1", "state": "released", "phase": "ended", "labels": {"bg": "train"}}}, "bg"),
    ({"type": "warning", "user": "a", "lease_id": "l-1", "kind": "idle", "deadline": 5.0, "message": "m"},
     "warning"),
    ({"type": "lease.preempting", "user": "a", "lease_id": "l-1", "by_class": "high", "deadline": 5.0},
     "warning"),
    ({"type": "gpus", "user": None, "summary": {}}, None),
])
def test_which_events_make_a_message(event, kind) -> None:
    m = message(event)
    assert (m.kind if m else None) == kind
    if m is not None:
        assert m.user == "a" and m.lease_id == "l-1" and m.body()["text"] and m.key.startswith("l-1:")

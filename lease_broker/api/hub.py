"""JupyterHub as the source of identity: a user's Hub token (the ``$JUPYTERHUB_API_TOKEN`` of their single-user
server and kernels) becomes the Hub's user model (name, groups, scopes) through JupyterHub's own service-auth
library (``jupyterhub.services.auth.HubAuth``).

An answer is kept for ``cache_seconds`` and never past the token's own expiry (the Hub's token model,
``expires_at``, read once per token): a token revoked on the Hub stops working here within ``cache_seconds``, an
expired one at its expiry. While the Hub cannot be reached, only the answers still kept pass; any other token gets
503 naming the Hub's URL. Each peer (a uid on the Unix socket, an address over TCP) may cause
``failed_lookups_per_minute`` refused lookups (a token bucket that size, refilled at that rate); beyond it a token
the broker has not seen gets 429 with Retry-After, and the Hub is not asked. The Hub is asked on the broker's event
loop without blocking it (HubAuth's async API), one request per token however many callers present it at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Bool, List, Unicode, default
from traitlets.config import Configurable

from ..core.errors import LeaseError, TooManyRequests, Unauthorized, Unavailable
from ..core.identity import Namespaces
from ..policy import numbers

log = logging.getLogger("lease_broker")

#: The largest number of token answers kept; beyond it, answers older than they may be used are dropped.
MAX_ANSWERS = 4096


@dataclasses.dataclass(frozen=True)
class HubUser:
    """What the Hub says about a token's owner."""

    name: str
    groups: tuple[str, ...] = ()
    admin: bool = False  # a Hub admin, or the token carries one of HubIdentity.admin_scopes


@dataclasses.dataclass(frozen=True)
class _Answer:
    """The Hub's answer for one token, on the monotonic clock: kept while ``now < until``."""

    user: HubUser | None  # None: the Hub refused the token
    until: float  # the answer is used until then: its time + cache_seconds, never past the token's expiry
    expires: float | None = None  # when the token expires (None: never, or not known)


class HubIdentity(Configurable):
    """Identify callers by their JupyterHub token (``LeaseBroker.identity = 'hub'`` or ``'unix+hub'``)."""

    api_url = Unicode(
        config=True,
        help="The Hub's API URL, e.g. 'http://127.0.0.1:8081/hub/api' (the Hub's hub_ip:hub_port, reachable from "
        "the broker). Default: $JUPYTERHUB_API_URL, which the Hub sets for a managed service.",
    )
    cache_seconds = numbers.Float(
        30.0,
        config=True,
        help="Seconds the Hub's answer for a token is kept (never past the token's own expiry): a token revoked "
        "on the Hub stops working here within this many seconds, and while the Hub is down only tokens it accepted "
        "within this many seconds pass (a running lease's holder then has this plus LeasePolicy.heartbeat_timeout "
        "before the lease ends for want of heartbeats). 30 s: revocation takes effect within half a minute (the "
        "Hub's own single-user servers cache 300 s) at one Hub lookup per active token per 30 s. 0 = ask the Hub "
        "on every request (and nothing passes while it is down). Example: 30.",
    )
    failed_lookups_per_minute = numbers.Integer(
        10,
        config=True,
        help="Refused token lookups a peer (a uid on the Unix socket, an address over TCP) may cause: a burst of "
        "this many, then this many per minute; beyond that a token the broker has not seen gets 429 with "
        "Retry-After and the Hub is not asked (a token already accepted keeps working). Callers behind one uid or "
        "one proxy address share it. 0 = no limit. Example: 10.",
    )
    timeout = numbers.Float(
        5.0,
        config=True,
        help="Seconds to wait for the Hub's answer before treating the Hub as unreachable. Example: 5.",
    )
    admin_scopes = List(
        Unicode(),
        ["custom:gpulease:admin"],
        config=True,
        help="A token that carries any of these scopes is a broker admin. Define the custom scope in "
        "JupyterHub.custom_scopes, grant it through a role, and add it to Spawner.server_token_scopes so "
        "servers' tokens carry it (the Hub gives it only to users who hold it). [] = none.",
    )
    hub_admins = Bool(
        True,
        config=True,
        help="Whether the Hub's admins (admin: true in the Hub's user model) are broker admins.",
    )

    api_token = Unicode(
        config=True,
        help="The broker's own Hub token (a service's api_token), used only to read users' e-mail addresses from "
        "their auth_state for notifications (grant the service the scopes 'read:users' and 'admin:auth_state'). "
        "Default: $JUPYTERHUB_API_TOKEN, which the Hub sets for a managed service. Never logged.",
    )

    @default("api_url")
    def _default_api_url(self) -> str:
        return os.environ.get("JUPYTERHUB_API_URL", "")

    @default("api_token")
    def _default_api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    def __init__(self, namespaces: Namespaces | None = None, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.namespaces = namespaces or Namespaces.of("hub")
        self.monotonic, self.wall = monotonic, wall
        self._answers: dict[str, _Answer] = {}
        self._asking: dict[str, asyncio.Future[HubUser | None]] = {}
        self._credits: dict[str, tuple[float, float]] = {}  # peer -> (lookups it may still fail, when counted)
        self._auth: Any = None
        self.reachable = True
        self._expiry_unknown_told = False
        self._emails: dict[str, tuple[str | None, float]] = {}

    def start(self) -> None:
        """Check the configuration and load JupyterHub's service-auth library (a startup error names the fix)."""
        if not self.api_url:
            raise LeaseError(
                "LeaseBroker.identity uses JupyterHub, but the Hub's API URL is unknown: set HubIdentity.api_url "
                "(e.g. 'http://127.0.0.1:8081/hub/api') or run the broker as a Hub-managed service",
                reason="startup",
            )
        try:
            from jupyterhub.services.auth import HubAuth
        except ImportError as e:
            raise LeaseError(
                f"LeaseBroker.identity uses JupyterHub, but its service-auth library cannot be imported ({e}): "
                "pip install 'jupyter-gpulease[hub]' (or jupyterhub) beside the broker",
                reason="startup",
            ) from e
        # user_for_token authenticates with the caller's own token; the service token (a managed service's
        # $JUPYTERHUB_API_TOKEN) is not needed for that
        self._auth = HubAuth(api_url=self.api_url, cache_max_age=0)

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def key(token: str) -> str:
        return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()

    def cached(self, token: str) -> HubUser | None | bool:
        """A kept answer for ``token`` (a HubUser, or None: refused, also once it expired), or False: ask the Hub."""
        found = self._answers.get(self.key(token))
        if found is None:
            return False
        now = self.monotonic()
        if now < found.until:
            return found.user
        if found.user is not None and found.expires is not None and now >= found.expires:
            return None  # expired: the Hub would refuse it too
        return False

    async def resolve(self, token: str, peer: str = "") -> HubUser:
        """Ask the Hub who ``token`` belongs to (one request per token at a time; a peer without lookups left
        gets 429)."""
        key = self.key(token)
        asking = self._asking.get(key)
        if asking is None:
            known = self._answers.get(key)
            counted = (known is None or known.user is None) and self._take_lookup(peer)  # a token seen valid: free
            asking = self._asking[key] = asyncio.ensure_future(self._ask(token, key, peer if counted else None))
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        user = await asyncio.shield(asking)
        if user is None:
            raise self.refused()
        return user

    def refused(self) -> Unauthorized:
        return Unauthorized(
            f"The JupyterHub at {self.api_url} does not accept this token: it is invalid, expired or revoked. "
            "Restart your server from the Hub's home page (a new server gets a new $JUPYTERHUB_API_TOKEN), "
            "or create a token on the Hub's token page and send it as 'Authorization: token <token>'",
            reason="invalid_token",
        )

    # ------------------------------------------------------------------------------------------ failed lookups
    def _take_lookup(self, peer: str) -> bool:
        """Count a lookup against ``peer``'s bucket (given back unless the Hub refuses the token), or refuse it
        with 429. Returns whether it was counted."""
        rate = self.failed_lookups_per_minute
        if rate <= 0:
            return False
        now = self.monotonic()
        left, when = self._credits.get(peer, (float(rate), now))
        left = min(float(rate), left + (now - when) * rate / 60.0)
        if left < 1.0:
            wait = max(1, math.ceil((1.0 - left) * 60.0 / rate))
            raise TooManyRequests(
                f"Too many refused JupyterHub tokens from this caller ({rate} a minute): try again in {wait} s "
                "with a valid token (your server's $JUPYTERHUB_API_TOKEN, or one from the Hub's token page)",
                reason="too_many_failed_lookups", extra={"retry_after": wait},
            )
        if len(self._credits) >= MAX_ANSWERS:  # peers whose bucket is full again need no entry
            self._credits = {p: (c, t) for p, (c, t) in self._credits.items()
                             if c + (now - t) * rate / 60.0 < rate}
        self._credits[peer] = (left - 1.0, now)
        return True

    def _give_back_lookup(self, peer: str | None) -> None:
        found = self._credits.get(peer) if peer is not None else None
        if peer is not None and found is not None:
            self._credits[peer] = (min(float(self.failed_lookups_per_minute), found[0] + 1.0), found[1])

    # ------------------------------------------------------------------------------------------ asking the Hub
    async def _ask(self, token: str, key: str, peer: str | None) -> HubUser | None:
        """The Hub's answer for ``token``; ``peer``: whose failed lookup it counts as (None: nobody's)."""
        assert self._auth is not None, "HubIdentity.start() was not called"
        now = self.monotonic()
        try:
            model = await asyncio.wait_for(self._auth.user_for_token(token, use_cache=False, sync=False),
                                           self.timeout)
        except Exception as e:  # unreachable, timed out, or the Hub failed: HubAuth raises tornado HTTPErrors
            self._give_back_lookup(peer)  # the token was not refused
            why = getattr(e, "log_message", None) or str(e) or type(e).__name__
            if self.reachable:
                log.warning("JupyterHub at %s unreachable: %s", self.api_url, why)
                self.reachable = False
            raise Unavailable(
                f"The JupyterHub at {self.api_url} cannot be reached to check your token ({why}); leases already "
                "granted keep running. Try again when the Hub is back (ask your admin if it stays down)",
                reason="hub_unavailable",
            ) from None
        if not self.reachable:
            log.warning("JupyterHub at %s reachable again", self.api_url)
            self.reachable = True
        if not model:
            self._remember(key, _Answer(None, now + self.cache_seconds))
            return None
        self._give_back_lookup(peer)
        user = self._user(model)
        known = self._answers.get(key)
        expires = known.expires if known is not None and known.user is not None else await self._expiry(token, model)
        until = now + self.cache_seconds
        if expires is not None:
            if expires <= now:
                self._remember(key, _Answer(None, now + self.cache_seconds))
                return None
            until = min(until, expires)
        self._remember(key, _Answer(user, until, expires))
        return user

    async def _expiry(self, token: str, model: dict[str, Any]) -> float | None:
        """When ``token`` expires on the monotonic clock, from the Hub's token model (``expires_at``), read with
        the broker's own token (a service with 'read:tokens') or else the token itself; None: never, or the
        Hub would not say (then only cache_seconds bounds it)."""
        token_id, name = model.get("token_id"), model.get("name")
        if not token_id or not name or model.get("kind") == "service":
            return None
        url = f"{self.api_url.rstrip('/')}/users/{quote(str(name), safe='')}/tokens/{quote(str(token_id), safe='')}"
        for who in dict.fromkeys(t for t in (self.api_token, token) if t):
            req = HTTPRequest(url, headers={"Authorization": f"token {who}"}, connect_timeout=self.timeout,
                              request_timeout=self.timeout)
            try:
                resp = await AsyncHTTPClient().fetch(req, raise_error=False)
                if resp.code != 200:
                    continue
                at = json.loads(resp.body).get("expires_at")
            except Exception:
                continue
            if not at:
                return None  # never expires
            try:
                when = datetime.datetime.fromisoformat(str(at))
            except ValueError:
                break
            if when.tzinfo is None:
                when = when.replace(tzinfo=datetime.timezone.utc)  # the Hub's times are UTC
            return self.monotonic() + (when.timestamp() - self.wall())
        if not self._expiry_unknown_told:
            self._expiry_unknown_told = True
            log.info("JupyterHub at %s: cannot read a token's expiry (its token model); tokens are then bounded by "
                     "HubIdentity.cache_seconds only: grant the broker's service the scope 'read:tokens' "
                     "(HubIdentity.api_token)", self.api_url)
        return None

    async def email_of(self, name: str) -> str | None:
        """The e-mail address the Hub keeps for ``name`` (``auth_state['email']``, which authenticators such as
        GitHub's or Generic OAuth's can fill), read with the broker's own token; None when there is none or it
        cannot be read. Answers are kept ``cache_seconds``."""
        hub_name = self.namespaces.hub_name(name)
        if hub_name is None:
            return None  # a Unix user: the Hub's user of that name is someone else
        name = hub_name
        found = self._emails.get(name)
        now = self.monotonic()
        if found is not None and now - found[1] < self.cache_seconds:
            return found[0]
        address: str | None = None
        if self.api_token and self.api_url:
            req = HTTPRequest(f"{self.api_url.rstrip('/')}/users/{quote(name, safe='')}",
                              headers={"Authorization": f"token {self.api_token}"},
                              connect_timeout=self.timeout, request_timeout=self.timeout)
            try:
                resp = await AsyncHTTPClient().fetch(req, raise_error=False)
                if resp.code == 200:
                    state = json.loads(resp.body).get("auth_state") or {}
                    address = state.get("email") if isinstance(state.get("email"), str) else None
                else:
                    log.info("JupyterHub at %s: no user model for %s (HTTP %s): grant the broker's service "
                             "'read:users' and 'admin:auth_state' for e-mail from the Hub", self.api_url, name,
                             resp.code)
            except Exception as e:
                log.info("JupyterHub at %s: cannot read %s's e-mail address: %s", self.api_url, name,
                         type(e).__name__)
        self._emails[name] = (address, now)
        return address

    def _user(self, model: dict[str, Any]) -> HubUser:
        name = str(model.get("name", ""))
        if model.get("kind") == "service":
            name = "service:" + name
        scopes = set(model.get("scopes") or ())
        admin = bool(self.hub_admins and model.get("admin")) or bool(scopes & set(self.admin_scopes))
        return HubUser(name=name, groups=tuple(sorted(model.get("groups") or ())), admin=admin)

    def _remember(self, key: str, answer: _Answer) -> None:
        if len(self._answers) >= MAX_ANSWERS:  # answers no longer used go first
            now = self.monotonic()
            self._answers = {k: v for k, v in self._answers.items() if now < v.until}
        self._answers[key] = answer


def remembering(learn: Callable[[str, tuple[str, ...]], bool],
                remember: Callable[[str, tuple[str, ...], float], None]) -> Callable[[str, tuple[str, ...]], None]:
    """The Authenticator's ``learn_groups``: tell the policy a user's Hub groups and, when they changed, store
    them (a restarted broker then counts a user's group quota before the user calls again)."""
    def learn_groups(user: str, groups: tuple[str, ...]) -> None:
        if learn(user, groups):
            remember(user, groups, time.time())

    return learn_groups

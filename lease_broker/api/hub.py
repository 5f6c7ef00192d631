"""JupyterHub as the source of identity: a user's Hub token (the ``$JUPYTERHUB_API_TOKEN`` of their single-user
server and kernels) becomes the Hub's user model (name, groups, scopes) through JupyterHub's own service-auth
library (``jupyterhub.services.auth.HubAuth``).

Answers are kept for ``cache_seconds``: a token the Hub revokes keeps working here for at most that long. While
the Hub cannot be reached, a token the Hub accepted within ``outage_seconds`` keeps its last answer, so the
holders of running leases can still heartbeat, renew and release them; a token the broker has not seen gets 503
naming the Hub's URL. The Hub is asked on the broker's event loop without blocking it (HubAuth's async API),
one request per token however many callers present it at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Bool, Float, List, Unicode, default
from traitlets.config import Configurable

from ..core.clock import Clock
from ..core.errors import LeaseError, Unauthorized, Unavailable

log = logging.getLogger("lease_broker")

#: The largest number of token answers kept; beyond it, answers older than they may be used are dropped.
MAX_ANSWERS = 4096


@dataclasses.dataclass(frozen=True)
class HubUser:
    """What the Hub says about a token's owner."""

    name: str
    groups: tuple[str, ...] = ()
    admin: bool = False  # a Hub admin, or the token carries one of HubIdentity.admin_scopes


class HubIdentity(Configurable):
    """Identify callers by their JupyterHub token (``LeaseBroker.identity = 'hub'`` or ``'unix+hub'``)."""

    api_url = Unicode(
        config=True,
        help="The Hub's API URL, e.g. 'http://127.0.0.1:8081/hub/api' (the Hub's hub_ip:hub_port, reachable from "
        "the broker). Default: $JUPYTERHUB_API_URL, which the Hub sets for a managed service.",
    )
    cache_seconds = Float(
        60.0,
        config=True,
        help="Seconds the Hub's answer for a token is kept: a token revoked on the Hub keeps working here for at "
        "most this long. 0 = ask the Hub on every request. Example: 60.",
    )
    outage_seconds = Float(
        3600.0,
        config=True,
        help="While the Hub cannot be reached: seconds since the Hub last accepted a token during which it keeps "
        "working here (running leases stay renewable and releasable through an outage). 0 = none: every Hub "
        "token gets 503 while the Hub is down. Example: 3600.",
    )
    timeout = Float(
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

    def __init__(self, clock: Clock | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clock = clock or Clock()
        self._answers: dict[str, tuple[HubUser | None, float]] = {}
        self._asking: dict[str, asyncio.Future[HubUser | None]] = {}
        self._auth: Any = None
        self.reachable = True
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
        """A fresh answer for ``token`` (a HubUser, or None: the Hub refused it), or False: ask the Hub."""
        found = self._answers.get(self.key(token))
        if found is not None and self.clock.now() - found[1] < self.cache_seconds:
            return found[0]
        return False

    async def resolve(self, token: str) -> HubUser:
        """Ask the Hub who ``token`` belongs to (one request per token at a time)."""
        key = self.key(token)
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.ensure_future(self._ask(token, key))
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

    async def _ask(self, token: str, key: str) -> HubUser | None:
        assert self._auth is not None, "HubIdentity.start() was not called"
        now = self.clock.now()
        try:
            model = await asyncio.wait_for(self._auth.user_for_token(token, use_cache=False, sync=False),
                                           self.timeout)
        except Exception as e:  # unreachable, timed out, or the Hub failed: HubAuth raises tornado HTTPErrors
            why = getattr(e, "log_message", None) or str(e) or type(e).__name__
            if self.reachable:
                log.warning("JupyterHub at %s unreachable: %s", self.api_url, why)
                self.reachable = False
            stale = self._answers.get(key)
            if stale is not None and stale[0] is not None and now - stale[1] < self.outage_seconds:
                return stale[0]
            raise Unavailable(
                f"The JupyterHub at {self.api_url} cannot be reached to check your token ({why}); leases already "
                "granted keep running. Try again when the Hub is back (ask your admin if it stays down)",
                reason="hub_unavailable",
            ) from None
        if not self.reachable:
            log.warning("JupyterHub at %s reachable again", self.api_url)
            self.reachable = True
        user = self._user(model) if model else None
        self._remember(key, user, now)
        return user

    async def email_of(self, name: str) -> str | None:
        """The e-mail address the Hub keeps for ``name`` (``auth_state['email']``, which authenticators such as
        GitHub's or Generic OAuth's can fill), read with the broker's own token; None when there is none or it
        cannot be read. Answers are kept ``cache_seconds``."""
        found = self._emails.get(name)
        now = self.clock.now()
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

    def _remember(self, key: str, user: HubUser | None, now: float) -> None:
        if len(self._answers) >= MAX_ANSWERS:  # refusals are kept only while fresh, acceptances through an outage
            fresh, kept = self.cache_seconds, max(self.cache_seconds, self.outage_seconds)
            self._answers = {k: v for k, v in self._answers.items() if now - v[1] < (kept if v[0] else fresh)}
        self._answers[key] = (user, now)


def remembering(learn: Callable[[str, tuple[str, ...]], bool],
                remember: Callable[[str, tuple[str, ...], float], None]) -> Callable[[str, tuple[str, ...]], None]:
    """The Authenticator's ``learn_groups``: tell the policy a user's Hub groups and, when they changed, store
    them (a restarted broker then counts a user's group quota before the user calls again)."""
    def learn_groups(user: str, groups: tuple[str, ...]) -> None:
        if learn(user, groups):
            remember(user, groups, time.time())

    return learn_groups

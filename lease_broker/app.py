"""`lease-broker`: the command that serves the broker. Wiring only."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
from typing import Any

from tornado import ioloop
from traitlets import Bool, CaselessStrEnum, Float, Instance, Integer, List, Type, Unicode, default
from traitlets.config import Application, catch_config_error

from gpulease_protocol import address
from gpulease_protocol.entry_points import EntryPointType

from . import __version__
from .api.auth import MODES, Admins, Authenticator
from .api.hub import HubIdentity, remembering
from .core.clock import Clock
from .core.errors import LeaseError
from .core.identity import Namespaces, hash_secret, new_token
from .inventory import Inventory
from .inventory.nvml import NVMLInventory
from .inventory.simulated import SimulatedInventory
from .manager.manager import LeaseManager
from .notify.notifier import Notifier
from .policy import numbers
from .policy.lease_policy import LeasePolicy
from .service import BrokerService, trusted_place
from .store.lease_store import Store
from .store.lock import StoreLock
from .store.notify_store import NotifyStore


class TokenApp(Application):
    name = "lease-broker token"
    description = "Issue or revoke bearer tokens for clients that reach the broker over TCP."
    db_path = Unicode("", config=True, help="Lease store (SQLite) path; default: the broker's.")
    admin = Bool(False, config=True, help="Issue an admin token.")
    note = Unicode("", config=True, help="A note stored with the token.")
    aliases = {"db": "TokenApp.db_path", "note": "TokenApp.note"}
    flags = {"admin": ({"TokenApp": {"admin": True}}, "Issue an admin token.")}

    def start(self) -> None:
        if len(self.extra_args) != 2 or self.extra_args[0] not in ("create", "revoke"):
            sys.exit("usage: lease-broker token create USER [--admin] | lease-broker token revoke USER")
        action, user = self.extra_args
        store = Store(self.db_path or LeaseBroker().db_path)
        if action == "create":
            token = new_token()
            store.add_token(hash_secret(token), user, self.admin, Clock().now(), self.note)
            print(token)
        else:
            print(f"revoked {store.revoke_tokens(user)} token(s) of {user}")


class LeaseBroker(Application):
    name = "lease-broker"
    version = __version__
    description = "Lease GPUs to notebook cells: a broker that queues requests and grants time-limited leases."
    examples = "lease-broker --inventory=simulated --gpus=4\nlease-broker --generate-config"
    classes = [LeasePolicy, HubIdentity, SimulatedInventory, NVMLInventory, Notifier]

    inventory_class = EntryPointType(
        "auto",
        Inventory,
        group="jupyter_gpulease.inventories",
        config=True,
        help="Where GPUs come from: 'nvml' (the NVIDIA driver), 'simulated' (demo/test GPUs, labelled "
        "simulated everywhere), 'ray', 'slurm', another entry-point name of jupyter_gpulease.inventories, "
        "'module:Class' or an Inventory subclass. 'auto' is NVML, which refuses to start without an NVIDIA driver.",
    )
    policy_class = Type(LeasePolicy, klass=LeasePolicy, config=True,
                        help="The LeasePolicy (sub)class that limits requests, e.g. 'mypackage.MyPolicy'.")
    store_class = Type(Store, klass=Store, config=True,
                       help="The lease store (a Store subclass) that keeps leases in SQLite at db_path.")
    socket_path = Unicode(
        config=True,
        help="Unix socket to serve on (callers are identified by their uid). Default: "
        "/run/gpulease/broker.sock as root, else $XDG_RUNTIME_DIR/gpulease/broker.sock or "
        "/tmp/gpulease-<uid>/broker.sock. Empty string = no Unix socket.",
    )
    port = Integer(0, config=True, help="TCP port for bearer-token clients (other nodes). 0 = no TCP listener.")
    ip = Unicode("127.0.0.1", config=True, help="Address of the TCP listener, e.g. '0.0.0.0'.")
    db_path = Unicode(config=True, help="SQLite file of the lease store. ':memory:' keeps nothing (tests only).")
    identity = CaselessStrEnum(
        MODES,
        "unix",
        config=True,
        help="What names a caller. 'unix': on the Unix socket the caller's uid (SO_PEERCRED), over TCP a broker "
        "token (one host with a Unix user per person: TLJH, SystemdSpawner, LocalProcessSpawner). 'hub': a "
        "JupyterHub token (the $JUPYTERHUB_API_TOKEN that servers and kernels present by themselves) or a broker "
        "token, never a uid (containers that share uids: DockerSpawner, KubeSpawner; see HubIdentity). "
        "'unix+hub': a token when one is sent, else the Unix socket's uid.",
    )
    admin_users = List(
        Unicode(), config=True,
        help="Unix user names that act on every lease (and names of broker tokens), e.g. ['alice']. JupyterHub users "
        "are named in hub_admin_users.",
    )
    admin_groups = List(
        Unicode(), config=True,
        help="Unix groups whose members act on every lease, e.g. ['gpuadmin']; membership is read again at least "
        "every admin_cache_seconds and on SIGHUP. JupyterHub groups are named in hub_admin_groups.",
    )
    hub_admin_users = List(
        Unicode(), config=True,
        help="JupyterHub user names that act on every lease (identity 'hub' or 'unix+hub'), e.g. ['carol']. A Hub "
        "user is never an admin by sharing a name with a Unix admin.",
    )
    hub_admin_groups = List(
        Unicode(), config=True,
        help="JupyterHub groups whose members act on every lease, as the Hub names them with each token "
        "(identity 'hub' or 'unix+hub'), e.g. ['gpu-admins'].",
    )
    hub_users_are_unix_users = Bool(
        False, config=True,
        help="Whether a JupyterHub user is the Unix user of the same name (the Hub's names are this host's users, "
        "e.g. PAM or LocalProcessSpawner): then leases, quotas and admin lists are shared between them. False: "
        "two principals; under identity 'unix+hub' a Hub user's leases are owned by 'hub:NAME'. Example: True.",
    )
    admin_cache_seconds = numbers.Float(
        60.0, config=True,
        help="Seconds a user's Unix group membership is kept for admin_groups before it is read again (SIGHUP "
        "reads it again at once): a member removed from an admin group stops being an admin within this many "
        "seconds. 0 = read it on every request. Example: 60.",
    )
    root_is_admin = Bool(True, config=True, help="Whether uid 0 on the Unix socket is an admin (never with identity 'hub').")
    tick_seconds = Float(1.0, config=True, help="Seconds between enforcement ticks (expiry, idleness). Example: 1.")
    sample_seconds = Float(2.0, config=True, help="Seconds between inventory samples (NVML use); 0 = never.")
    request_timeout = Float(30.0, config=True, help="Seconds a client may take to send a request body after its headers (tornado's "
                            "body_timeout; a connection idle for 10 times this, its headers unsent too, is closed). "
                            "Example: 30.")
    max_connections = numbers.Integer(
        0, config=True,
        help="Connections the broker keeps open at once, from everyone (each holds a file descriptor); one more is "
        "answered 503 with Retry-After and closed. 0 = as many as the limit of open files allows (the broker raises "
        "its soft limit to the hard one and keeps 96 descriptors for itself), never more. Example: 4000.",
    )
    max_connections_per_peer = numbers.Integer(
        1000, config=True,
        help="Connections one peer may keep open at once: one uid on the Unix socket, one address over TCP (raise it "
        "where many people share one: containers with one uid, a proxy); one more is answered 429 with Retry-After "
        "and closed. Held to half of max_connections, so one peer always leaves room for others. 0 = no limit per "
        "peer. Example: 1000.",
    )
    config_file = Unicode("lease_broker_config.py", config=True, help="Config file to load (Python, traitlets).")
    ready_fd = Integer(
        -1,
        config=True,
        help="A file descriptor the broker inherits and writes one JSON line to, then closes: "
        '{"ready": true, "urls": [...], "inventory": kind} once it serves, or {"ready": false, "reason": slug, '
        '"message": text} when it cannot start (what a process that starts it waits on), e.g. 3. -1: none.',
    )
    generate_config = Bool(False, config=True, help="Print a config file documenting every option, then exit.")

    policy = Instance(LeasePolicy)
    inventory = Instance(Inventory, allow_none=True)
    hub = Instance(HubIdentity, allow_none=True)

    aliases = {
        "inventory": "LeaseBroker.inventory_class",
        "gpus": "SimulatedInventory.gpus",
        "nodes": "SimulatedInventory.nodes",
        "socket": "LeaseBroker.socket_path",
        "port": "LeaseBroker.port",
        "ip": "LeaseBroker.ip",
        "db": "LeaseBroker.db_path",
        "config": "LeaseBroker.config_file",
        "log-level": "Application.log_level",
        "heartbeat-timeout": "LeasePolicy.heartbeat_timeout",
        "tick": "LeaseBroker.tick_seconds",
        "identity": "LeaseBroker.identity",
        "ready-fd": "LeaseBroker.ready_fd",
    }
    flags = {
        "debug": ({"Application": {"log_level": logging.DEBUG}}, "Log at DEBUG level."),
        "generate-config": (
            {"LeaseBroker": {"generate_config": True}},
            "Print a lease_broker_config.py documenting every option (redirect it to a file), then exit.",
        ),
    }
    subcommands = {"token": (TokenApp, TokenApp.description)}

    @default("socket_path")
    def _default_socket(self) -> str:
        return address.listen_socket()

    @default("db_path")
    def _default_db(self) -> str:
        if os.geteuid() == 0:
            return "/var/lib/gpulease/leases.db"
        base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        return os.path.join(base, "gpulease", "leases.db")

    @default("log_level")
    def _log_level(self) -> int:
        return logging.INFO

    @default("log_format")
    def _log_format(self) -> str:
        return "[%(name)s %(levelname)1.1s %(asctime)s] %(message)s"

    @catch_config_error
    def initialize(self, argv: Any = None) -> None:
        super().initialize(argv)
        if self.subapp is not None or self.generate_config:
            return
        if self.config_file and os.path.exists(self.config_file):
            self.load_config_file(self.config_file)
        for name in ("lease_broker", "tornado.access"):
            logging.getLogger(name).handlers = self.log.handlers
            logging.getLogger(name).setLevel(self.log_level)  # type: ignore[arg-type]
            logging.getLogger(name).propagate = False
        self.policy = self.policy_class(parent=self, unix_user_of=self.namespaces().unix_name)
        if self.identity != "unix":
            self.hub = HubIdentity(parent=self, namespaces=self.namespaces())
            self.hub.start()
            if self.identity == "hub" and not self.hub_users_are_unix_users and (self.admin_users or self.admin_groups):
                self.log.warning("LeaseBroker.admin_users and admin_groups name Unix users and groups, which identity "
                                 "'hub' does not know: name JupyterHub admins in LeaseBroker.hub_admin_users and "
                                 "hub_admin_groups (or set LeaseBroker.hub_users_are_unix_users = True)")
        self.inventory = self.inventory_class(parent=self)

    def announce(self, status: dict[str, Any]) -> None:
        """Write ``status`` as the one line on ``ready_fd`` and close it (once; nothing without one)."""
        fd, self.ready_fd = self.ready_fd, -1
        if fd >= 0:
            try:
                os.write(fd, (json.dumps(status) + "\n").encode())
                os.close(fd)
            except OSError as e:
                self.log.warning("Cannot write the broker's status to --ready-fd=%d: %s", fd, e)

    def namespaces(self) -> Namespaces:
        return Namespaces.of(self.identity, self.hub_users_are_unix_users)

    def start(self) -> None:
        if self.subapp is not None:
            self.subapp.start()
            return
        if self.generate_config:
            print(self.generate_config_file())
            return
        assert self.inventory is not None
        if self.db_path != ":memory:":
            directory = os.path.dirname(os.path.abspath(self.db_path))
            try:
                os.makedirs(directory, mode=0o700, exist_ok=True)
            except OSError as e:
                raise LeaseError(f"Cannot make the lease store's directory {directory} ({e.strerror}): point --db "
                                 "(LeaseBroker.db_path) at a file in a directory the broker can make or write",
                                 reason="startup") from None
            trusted_place(self.db_path, "the lease store", "--db")  # no other user may delete or replace it
        # Restoring builds an object per lease and per GPU: without the cyclic GC, which would traverse them all
        # again and again meanwhile (a third of a 10,000-lease restart). Frozen afterwards, these long-lived
        # objects are not traversed by later collections either, which would otherwise stall requests.
        lock = StoreLock(self.db_path)  # one broker per store, for this process's whole life (store/lock.py)
        lock.acquire()
        gc.disable()
        try:
            store = self.store_class(self.db_path)
            manager = LeaseManager(store, self.inventory, self.policy)
            for user, groups in manager.admin_store.learned_groups().items():  # JupyterHub's, known before calls
                self.policy.learn_groups(user, groups)
            counts = manager.restore()
        finally:
            gc.freeze()
            gc.enable()
        hub = self.hub
        admins = Admins(self.namespaces(), self.admin_users, self.admin_groups, self.hub_admin_users,
                        self.hub_admin_groups, self.root_is_admin, self.admin_cache_seconds)
        auth = Authenticator(store, admins, self.identity, hub,
                             remembering(self.policy.learn_groups, manager.admin_store.remember_groups),
                             self.namespaces())
        info = {"version": __version__, "broker": self.name}
        notifier = Notifier(NotifyStore(store), manager.events.subscribe, self.policy.groups_of,
                            email_of=hub.email_of if hub is not None else None, parent=self)
        service = BrokerService(manager, auth, info, self.tick_seconds, self.sample_seconds, self.request_timeout,
                                notifier, self.max_connections, self.max_connections_per_peer)
        where = []
        if self.socket_path:
            service.listen_unix(self.socket_path)
            where.append(f"unix://{self.socket_path}")
        if self.port:
            port = service.listen_tcp(self.port, self.ip)
            where.append(f"http://{self.ip}:{port}")
        if not where:
            raise LeaseError("Nothing to listen on: set --socket or --port", reason="startup")
        service.start()
        gpus = manager.gpus
        self.log.info(
            "Broker %s serving %d %s GPU(s) on %d node(s) at %s; identity %s%s; restored %s; store %s",
            __version__, len(gpus), self.inventory.kind, len({g.node for g in gpus}), ", ".join(where),
            self.identity, f" (JupyterHub at {hub.api_url})" if hub else "", counts, self.db_path,
        )
        loop = ioloop.IOLoop.current()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_event_loop().add_signal_handler(sig, lambda: loop.add_callback_from_signal(loop.stop))
        def reload() -> None:  # SIGHUP: read groups again, re-read the config file, apply its policy
            admins.forget()
            self.policy.reload()
            manager.policy_admin.reload_file(self.config_file, self.cli_config)

        asyncio.get_event_loop().add_signal_handler(signal.SIGHUP, reload)
        # announce readiness last, so supervisors and tests can wait for it
        print(f"lease-broker ready: {' '.join(where)}", flush=True)
        self.announce({"ready": True, "urls": where, "inventory": self.inventory.kind})
        try:
            loop.start()
        finally:
            service.stop()
            store.close()
            lock.release()
            self.inventory.close()


def main(argv: list[str] | None = None) -> None:
    try:
        LeaseBroker.launch_instance(argv)
    except LeaseError as e:
        print(f"lease-broker: {e.message}", file=sys.stderr)
        if LeaseBroker.initialized():
            LeaseBroker.instance().announce({"ready": False, "reason": e.reason, "message": e.message})
        sys.exit(2)


if __name__ == "__main__":
    main()

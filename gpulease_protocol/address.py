"""Where the broker listens, and where a client looks for it: the one definition of the default socket.

A client (kernel, CLI, Jupyter server) looks, in order, at ``GPULEASE_BROKER``
(``unix:///path/to.sock`` or ``http://host:port``), then the system broker's socket
``/run/gpulease/broker.sock`` when it exists, then the per-user socket.

A broker started without ``--socket`` listens on the system socket when it runs as root, else on the
per-user socket: ``$XDG_RUNTIME_DIR/gpulease/broker.sock``, else ``/tmp/gpulease-<uid>/broker.sock``.
So where a broker listens by default and where a client looks differ in one way only: a client prefers a
running system broker even when the user has a per-user socket (a user's own broker then needs
``GPULEASE_BROKER``); and a broker does not read ``GPULEASE_BROKER``.

A client presents ``client_token()`` as ``Authorization: Bearer <token>``: ``GPULEASE_TOKEN`` (a token the broker's
admin issued), else ``JUPYTERHUB_API_TOKEN`` (which JupyterHub gives every single-user server and its kernels; a
broker with ``LeaseBroker.identity = 'hub'`` learns the user from the Hub with it, one in 'unix' mode ignores it on
its Unix socket). So under JupyterHub there is nothing for a user to set up.
"""

from __future__ import annotations

import os

SYSTEM_SOCKET = "/run/gpulease/broker.sock"


def per_user_socket() -> str:
    """``$XDG_RUNTIME_DIR/gpulease/broker.sock`` (not for root), else ``/tmp/gpulease-<uid>/broker.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.geteuid() != 0:
        return os.path.join(runtime, "gpulease", "broker.sock")
    return f"/tmp/gpulease-{os.getuid()}/broker.sock"


def listen_socket() -> str:
    """Where a broker listens by default: the system socket for root, else the per-user socket."""
    return SYSTEM_SOCKET if os.geteuid() == 0 else per_user_socket()


def broker_url() -> str:
    """Where a client looks: ``GPULEASE_BROKER``, else a running system broker, else ``listen_socket()``."""
    env = os.environ.get("GPULEASE_BROKER")
    if env:
        return env
    if os.path.exists(SYSTEM_SOCKET):
        return "unix://" + SYSTEM_SOCKET
    return "unix://" + listen_socket()


def client_token() -> str | None:
    """The token a client presents: ``GPULEASE_TOKEN``, else ``JUPYTERHUB_API_TOKEN``, else None."""
    return os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN") or None


def auth_headers(token: str | None) -> dict[str, str]:
    """The request headers that present ``token`` (none for no token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}

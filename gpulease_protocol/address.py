"""Where the broker listens, and where a client looks for it: the one definition of the default socket.

A client (kernel, CLI, Jupyter server) looks, in order, at ``GPULEASE_BROKER``
(``unix:///path/to.sock``, a bare socket path, or ``http://host:port``; ``check_broker_url`` is the one check of it
and of ``--broker``), then the system broker's socket
``/run/gpulease/broker.sock`` when it exists, then the per-user socket.

A broker started without ``--socket`` listens on the system socket when it runs as root, else on the
per-user socket: ``$XDG_RUNTIME_DIR/gpulease/broker.sock``, else ``/tmp/gpulease-<uid>/broker.sock``.
So where a broker listens by default and where a client looks differ in one way only: a client prefers a
running system broker even when the user has a per-user socket (a user's own broker then needs
``GPULEASE_BROKER``); and a broker does not read ``GPULEASE_BROKER``.

**A socket a client can trust.** Before a client sends anything over a Unix socket it checks, with
``private.trusted_path``, that the socket and every directory above it belong to the user or root and that no
other user can replace them (so a name in ``/tmp`` that another user made first is refused); after connecting it
checks the server's uid with ``SO_PEERCRED``: root or the user, nobody else. ``connect_unix`` is that one check,
and every client (``BrokerClient`` through ``http.client``, the ``gpulease`` CLI, the Jupyter server extension and its
event relay) connects through it. A refusal is an ``UntrustedSocket`` that names the socket, the owner found and
the fix; nothing was sent.

**Tokens.** ``client_token()`` is ``GPULEASE_TOKEN`` (a token the broker's admin issued), else
``JUPYTERHUB_API_TOKEN`` (which JupyterHub gives every single-user server and its kernels). Over TCP a client
presents it as ``Authorization: Bearer <token>`` on every request. Over a Unix socket the uid names the caller, so
it is not sent: only when the broker asks for a token on that socket (``asks_for_token``: a 401 with a
``WWW-Authenticate: Bearer`` challenge, as a broker with ``LeaseBroker.identity = 'hub'`` answers) does the client
send the request again with it, and from then on, and only to a server that passed the checks above. So under
JupyterHub there is still nothing for a user to set up. A token a program passes explicitly
(``BrokerClient(token=...)``) is presented as given, over the socket too (to a server that passed the checks).
"""

from __future__ import annotations

import os
import socket
import struct
import urllib.parse

from .private import UnsafePathError, trusted_path, user_text

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


BROKER_FORMS = "unix:///path/to.sock, a socket path like /run/gpulease/broker.sock, or http://host:port"


def check_broker_url(url: str, where: str = "the broker URL") -> str:
    """The broker address ``url`` in its one written form, ``unix:///path`` or ``http://host:port``: the one check
    of ``GPULEASE_BROKER``, ``--broker`` and ``BrokerClient(url)``. A bare socket path (``/run/x.sock``,
    ``./x.sock``, ``~/x.sock``) is a Unix socket; anything else (``garbage``, ``host:port``, ``https://``) is a
    ``ValueError`` that names ``where`` and the forms accepted (``BROKER_FORMS``), before anything is sent."""
    text = url.strip()

    def refuse(why: str = "") -> ValueError:
        return ValueError(f"{where}={url!r} is not a broker address{why}: use {BROKER_FORMS}")

    if "://" not in text:
        if text.startswith(("/", "./", "../", "~")):
            return "unix://" + os.path.abspath(os.path.expanduser(text))
        raise refuse()
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme == "unix":
        path = parsed.path or parsed.netloc
        if not path:
            raise refuse(" (no socket path)")
        return "unix://" + path if path.startswith("/") else text
    if parsed.scheme != "http":
        raise refuse()
    try:
        parsed.port  # noqa: B018 (urllib checks the port when asked for it)
    except ValueError:
        raise refuse(" (the port is not a number from 1 to 65535)") from None
    if not parsed.hostname:
        raise refuse(" (no host)")
    return text.rstrip("/")


def broker_url() -> str:
    """Where a client looks: ``GPULEASE_BROKER`` (checked by ``check_broker_url``), else a running system broker,
    else ``listen_socket()``."""
    env = os.environ.get("GPULEASE_BROKER", "").strip()
    if env:
        return check_broker_url(env, "GPULEASE_BROKER")
    if os.path.exists(SYSTEM_SOCKET):
        return "unix://" + SYSTEM_SOCKET
    return "unix://" + listen_socket()


def client_token() -> str | None:
    """The token a client presents: ``GPULEASE_TOKEN``, else ``JUPYTERHUB_API_TOKEN``, else None."""
    return os.environ.get("GPULEASE_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN") or None


def auth_headers(token: str | None) -> dict[str, str]:
    """The request headers that present ``token`` (none for no token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def asks_for_token(status: int, www_authenticate: str | None) -> bool:
    """Whether an answer asks the client for a token: 401 with a ``Bearer`` (or ``token``) challenge."""
    scheme = (www_authenticate or "").strip().split(" ", 1)[0].lower()
    return status == 401 and scheme in ("bearer", "token")


class UntrustedSocket(UnsafePathError):
    """A broker socket the client refused before sending anything: the message names it, who owns or serves it and
    what to do."""


_FIX = "ask root or your admin to remove it, or point GPULEASE_BROKER at a broker you or root run"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def check_socket(path: str) -> None:
    """Refuse the socket ``path`` unless it and its directories belong to the user or root and no other user can
    replace them (``private.trusted_path``). A missing socket is ``FileNotFoundError`` as usual."""
    try:
        trusted_path(path)
    except UnsafePathError as e:
        raise UntrustedSocket(f"Refusing the broker socket {path} (nothing was sent): {e} (GPULEASE_BROKER "
                              "chooses another broker)") from None
    except PermissionError:
        # a directory on the way that this user may not enter: name its owner if it is another user
        here = os.path.dirname(os.path.abspath(path))
        while True:
            try:
                owner = os.lstat(here).st_uid
            except OSError:
                owner = None
            if owner is not None and owner not in (0, os.geteuid()):
                raise UntrustedSocket(f"Refusing the broker socket {path} (nothing was sent): {here} belongs to "
                                      f"{user_text(owner)}, who could answer in your place: {_FIX}") from None
            if os.path.dirname(here) == here:
                raise
            here = os.path.dirname(here)


def check_peer(sock: socket.socket, path: str) -> None:
    """Refuse the server at the other end of the connected Unix socket ``sock`` unless it runs as root or as this
    user (``SO_PEERCRED``: the credentials of the process that listens). Not on systems without ``SO_PEERCRED``."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    if uid not in (0, os.geteuid()):
        raise UntrustedSocket(f"Refusing the broker at {path} (nothing was sent): it is served by {user_text(uid)} "
                              f"(pid {pid}), not by you or root, who could answer in your place: {_FIX}")


def connect_unix(path: str, timeout: float | None) -> socket.socket:
    """A connection to the broker's Unix socket ``path``, made only if the socket can be trusted (``check_socket``)
    and checked for the server's uid (``check_peer``) before it is returned: the one way a client connects."""
    check_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        check_peer(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock

"""The Jupyter server extension: configuration, broker discovery or an embedded broker, and handler wiring."""

from __future__ import annotations

import asyncio
import atexit
import os
from typing import Any

from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, Float, Integer, Unicode, default, validate

from gpulease_protocol.address import broker_url, check_broker_url, per_user_socket

from ..artifacts import default_root
from ..client import BrokerClient, BrokerError
from .embedded import EmbeddedBroker
from .handlers import default_handlers
from .relay import BrokerRelay


class GpuLease(ExtensionApp):
    """Serve the GPU lease broker to JupyterLab under ``{base_url}/gpulease/`` (REST proxy, events, artifacts)."""

    name = "jupyter_gpulease"
    description = __doc__
    load_other_extensions = True

    default_url = Unicode(
        "/lab",
        config=True,
        help="Unused: the extension serves no page of its own and is not launched standalone (e.g. '/lab').",
    )
    broker_url = Unicode(
        "",
        config=True,
        help="URL of the GPU lease broker, e.g. 'unix:///run/gpulease/broker.sock' or 'http://gpu-host:8765'. "
        "Empty (the default) means the GPULEASE_BROKER environment variable, else a broker answering at the "
        "default socket (/run/gpulease/broker.sock, then the per-user socket), else an embedded broker "
        "(see embedded_broker). A configured broker is used as is, even when it is down.",
    )
    embedded_broker = Bool(
        True,
        config=True,
        help="Start a per-user broker subprocess when no broker is configured and none answers "
        "(real GPUs when an NVIDIA driver is present, else embedded_gpus simulated GPUs, labelled simulated). "
        "It is stopped with the server, and kernels started by this server use it. False = never start one.",
    )
    embedded_gpus = Integer(
        4,
        config=True,
        help="Number of simulated GPUs of the embedded broker on a host without an NVIDIA driver, e.g. 4. "
        "Must be at least 1.",
    )
    embedded_socket = Unicode(
        config=True,
        help="Unix socket path of the embedded per-user broker, e.g. '/tmp/gpulease-1000/broker.sock'. "
        "Default: $XDG_RUNTIME_DIR/gpulease/broker.sock (non-root), else /tmp/gpulease-<uid>/broker.sock. "
        "A broker already answering there (another server's) is reused.",
    )
    artifact_root = Unicode(
        config=True,
        help="Directory holding one artifact directory per lease (written by %%gpu), listed by the sidebar, "
        "e.g. '~/gpulease-artifacts'. Default: the GPULEASE_ARTIFACT_ROOT environment variable, "
        "else ~/gpulease-artifacts. Remote fsspec URLs are not listed.",
    )
    probe_timeout = Float(
        2.0,
        config=True,
        help="Seconds to wait for a broker to answer when looking for one at startup, e.g. 2.0.",
    )
    request_timeout = Float(
        30.0,
        config=True,
        help="Seconds a proxied request may wait for the broker before answering 503, e.g. 30.0.",
    )

    @default("embedded_socket")
    def _default_embedded_socket(self) -> str:
        return per_user_socket()

    @default("artifact_root")
    def _default_artifact_root(self) -> str:
        return default_root()

    @validate("embedded_gpus")
    def _validate_gpus(self, proposal: Any) -> int:
        if proposal["value"] < 1:
            raise ValueError(f"GpuLease.embedded_gpus must be at least 1, not {proposal['value']!r}")
        return int(proposal["value"])

    @validate("embedded_socket")
    def _validate_socket(self, proposal: Any) -> str:
        path = os.path.abspath(os.path.expanduser(str(proposal["value"])))
        if len(path.encode()) > 104:
            raise ValueError(f"GpuLease.embedded_socket {path!r} is too long for a Unix socket (104 bytes at most)")
        return path

    # ------------------------------------------------------------------ wiring
    def initialize_settings(self) -> None:
        self._relay: BrokerRelay | None = None
        self.embedded: EmbeddedBroker | None = None
        self._env_before: str | None = os.environ.get("GPULEASE_BROKER")
        self._env_set = False
        self.broker_url = self._resolve_broker()
        self.settings["gpulease_app"] = self

    def initialize_handlers(self) -> None:
        self.handlers.extend(default_handlers)

    def _answers(self, url: str) -> bool:
        client = BrokerClient(url, timeout=self.probe_timeout)
        try:
            client.info()
            return True
        except BrokerError:
            return False
        finally:
            client.close()

    def _resolve_broker(self) -> str:
        where = "GpuLease.broker_url" if self.broker_url else "GPULEASE_BROKER"
        configured = self.broker_url or os.environ.get("GPULEASE_BROKER", "")
        if configured:
            url = check_broker_url(configured, where)  # the one written form (a bare socket path too)
            self.log.info("GPU lease broker: %s (configured)", url)
            return url
        embedded_url = "unix://" + self.embedded_socket
        for url in dict.fromkeys([broker_url(), embedded_url]):
            if self._answers(url):
                self.log.info("GPU lease broker: %s (found)", url)
                self._export(url)
                return url
        if not self.embedded_broker:
            url = broker_url()
            self.log.warning("No GPU lease broker answers at %s and GpuLease.embedded_broker is False", url)
            return url
        self.embedded = EmbeddedBroker(self.embedded_socket, self.embedded_gpus, self.log)
        self.embedded.start()
        atexit.register(self.embedded.stop)
        self._export(self.embedded.url)
        return self.embedded.url

    def _export(self, url: str) -> None:
        """Kernels started by this server find the broker through GPULEASE_BROKER."""
        os.environ["GPULEASE_BROKER"] = url
        self._env_set = True

    def relay(self) -> BrokerRelay:
        """The proxy's way to the broker, made at the first request (in the server's running event loop)."""
        if self._relay is None:
            self._relay = BrokerRelay(self.broker_url, self.request_timeout)
        return self._relay

    def status(self) -> dict[str, Any]:
        return {
            "broker_url": self.broker_url,
            "embedded": self.embedded is not None,
            "embedded_inventory": self.embedded.inventory if self.embedded else None,
            "artifact_root": self.artifact_root,
        }

    async def stop_extension(self) -> None:
        if self.embedded is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.embedded.stop)
            atexit.unregister(self.embedded.stop)
        if self._env_set:
            if self._env_before is None:
                os.environ.pop("GPULEASE_BROKER", None)
            else:
                os.environ["GPULEASE_BROKER"] = self._env_before

"""Nothing listens beyond this machine unless a rendezvous endpoint names an address.

A ``torch.distributed.TCPStore`` server binds every interface (``*:PORT``) whatever host it
is given, and has no authentication: anyone who reaches the port reads and writes the
run's keys. When the rendezvous address is a loopback one (the default of ``rt.launch``,
``paratrain train`` and ``paratrain run``), paratrain therefore

* creates the store servers itself on a socket bound to that address (``master_listen_fd``):
  rank 0's store of spawned processes, and the two stores of torchrun's agent
  (:func:`agent_stores`);
* pins gloo's and NCCL's own sockets to the loopback interface (``GLOO_SOCKET_IFNAME``,
  ``NCCL_SOCKET_IFNAME``) unless the user set them (:func:`pin_interfaces`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from paratrain.utils import environment

LOOPBACK = "127.0.0.1"
_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if not host:
        return False
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listening_fd(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only (port 0: any free one); the caller owns the
    descriptor (a TCPStore server takes it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = LOOPBACK if host.lower() == "localhost" else host.strip("[]")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def store_server(host: str, port: int, timeout: timedelta, **options: Any) -> Any:
    """A TCPStore server listening on loopback ``host:port`` only."""
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        port,
        is_master=True,
        timeout=timeout,
        master_listen_fd=listening_fd(host, port),
        **options,
    )


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return None


def interface_environment() -> dict[str, str]:
    """The variables that bind gloo's and NCCL's sockets to the loopback interface, those
    the user has not set."""
    name = loopback_interface()
    if name is None:
        return {}
    env = environment.current()
    return {v: name for v in _INTERFACE_VARIABLES if not env.has(v)}


def pin_interfaces(master_addr: str | None) -> None:
    """Bind gloo's and NCCL's sockets to the loopback interface when the rendezvous is on
    loopback, unless the user chose an interface."""
    if is_loopback(master_addr):
        environment.export(interface_environment())


@contextlib.contextmanager
def agent_stores() -> Iterator[None]:
    """While torchrun's agent runs in this process on a loopback endpoint: its rendezvous
    store and the store it shares with its workers listen on loopback only.

    torch (2.13) creates both with ``TCPStore(host, port, is_master=True)``, which binds
    every interface; both are swapped here for :func:`store_server` on the same host.
    ``tests/integration/test_exposure.py`` fails should a later torch create them elsewhere.
    """
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    original_store = backend.TCPStore
    original_server = DynamicRendezvousHandler._create_tcp_store_server

    def tcp_store(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("is_master") and is_loopback(host):
            kwargs.pop("is_master")
            timeout = kwargs.pop("timeout", timedelta(seconds=300))
            try:
                return store_server(host, port, timeout, **kwargs)
            except OSError as exc:  # the port taken: torch then joins as a client
                raise RuntimeError(f"cannot listen on {host}:{port}: {exc}") from exc
        return original_store(host, port, *args, **kwargs)

    def server(self: Any, master_addr: str, master_port: int) -> Any:
        if is_loopback(master_addr):
            return store_server(master_addr, master_port, timedelta(seconds=300), multi_tenant=True)
        return original_server(self, master_addr, master_port)

    backend.TCPStore = tcp_store  # type: ignore[assignment,misc]
    DynamicRendezvousHandler._create_tcp_store_server = server  # type: ignore[method-assign]
    try:
        yield
    finally:
        backend.TCPStore = original_store  # type: ignore[misc]
        DynamicRendezvousHandler._create_tcp_store_server = original_server  # type: ignore[method-assign]

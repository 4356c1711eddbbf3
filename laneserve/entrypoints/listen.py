"""The server's listening socket, bound before the model loads.

uvicorn binds its socket only after the application has started, so a port in use
would be found out only once the model had loaded (and the loaded model thrown away).
`laneserve serve` binds first and hands the socket to uvicorn.
"""

from __future__ import annotations

import errno
import socket


class PortInUseError(OSError):
    """The address cannot be bound (in use, or not an address of this machine)."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn would bind it (SO_REUSEADDR, so a
    just-closed server's port is reusable); raises PortInUseError with a --port hint."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"port {port} on {host} is in use (another server?); "
                "stop that one or pick another port with --port"
            ) from None
        raise PortInUseError(f"cannot listen on {host}:{port}: {e.strerror}; see --host") from None
    return sock

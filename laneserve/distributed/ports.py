"""Where a group of ranks meets: a TCP port free now on one of this machine's addresses
(127.0.0.1, or node 0's `master_addr` when the ranks are on several machines)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])

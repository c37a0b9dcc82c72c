"""Free TCP ports on 127.0.0.1 for the processes the benches and tests start."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

__all__ = ["EPHEMERAL_PORTS", "free_port"]


#: Where the kernel takes the ports of ``bind(0)`` and of outgoing connections, when
#: /proc does not say (Linux's default).
EPHEMERAL_PORTS = (32768, 60999)


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return EPHEMERAL_PORTS


def free_port(*, also: int = 0) -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, outside the kernel's ephemeral
    range: a port handed out by ``bind(0)`` and closed again can be handed out again at
    once, to an engine's own internal sockets or as an outgoing connection's source
    port, before the process it was chosen for binds it. Ports from below the range (or
    above it, where the range starts low) are never handed out that way.

    With ``also``, the port ``also`` higher is free and outside the range too (a Redis
    Cluster node's bus port is its port + 10000); RuntimeError when no such pair is
    found."""
    low, high = _ephemeral_ports()
    spans = [(s, e - also) for s, e in ((10000, low), (high + 1, 65536)) if e - also - s >= 1000]
    rng = random.SystemRandom()
    for _ in range(200):
        start, end = rng.choice(spans) if spans else (1024, 65536 - also)
        port = rng.randrange(start, end)
        with contextlib.ExitStack() as held:
            try:
                for p in {port, port + also}:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p))
            except OSError:
                continue
            return port
    if also:
        raise RuntimeError(f"no free pair of ports {also} apart outside the ephemeral "
                           f"range {low}-{high}")
    with socket.socket() as s:  # everything tried is taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen

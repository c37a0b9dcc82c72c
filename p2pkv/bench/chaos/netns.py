"""The partition fault of a chaos run: a holder behind a veth link between two network
namespaces of the run's own, and that link cut.

Nothing of the machine's own network changes (root only)::

    consumers (this process) -> FaultProxy 127.0.0.1:F      the host's namespace
        -> its socket to the holder, made in namespace B    B: 10.203.0.2/30
        -> the veth link ------------------------------->   A: 10.203.0.1/30, the holder
    the holder's Redis client -> 127.0.0.1:R in A (a relay listening there)
        -> Redis on 127.0.0.1:R in the host's namespace; its metrics port the other way

The relays are threads of this process (:class:`FaultProxy` in pass mode). A socket
belongs to the namespace of the thread that made it, so a short-lived thread enters the
namespace (``setns(2)``) to make each one. :meth:`NetnsLink.cut` sets the holder's end
of the link down: what the holder and its consumers send each other is dropped, with no
FIN or RST, while the holder still reaches Redis: it stays registered, and consumers
must fail over from it. :meth:`NetnsLink.heal` sets it up again.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Sequence

from p2pkv.bench.chaos.proxy import FaultProxy
from p2pkv.bench.netns import Unavailable, check_available, in_netns, remove_stale
from p2pkv.bench.netns import ip as _ip

__all__ = ["NetnsLink", "Unavailable"]

_PREFIX = "p2pkv-chaos-"


class NetnsLink:
    """Namespaces ``a`` (the holder, ``ip_a``) and ``b`` (its consumers' end) joined by
    a veth pair; relays for ``redis_ports`` into ``a`` and for ``metrics_port`` out of
    it. Raises :class:`Unavailable` (with the reason) where namespaces cannot be made."""

    def __init__(self, redis_ports: Sequence[int], metrics_port: int, holder_port: int) -> None:
        check_available()
        remove_stale(_PREFIX)
        tag = f"{os.getpid()}"
        self.a, self.b = f"{_PREFIX}{tag}-a", f"{_PREFIX}{tag}-b"
        self.veth_a, self.veth_b = f"p2kcA{tag}"[:15], f"p2kcB{tag}"[:15]
        self.ip_a, self.ip_b = "10.203.0.1", "10.203.0.2"
        self.holder_port = holder_port
        self._made: list[str] = []
        self._relays: list[FaultProxy] = []
        added = _ip("netns", "add", self.a, check=False)
        if added.returncode != 0:
            raise Unavailable(f"'ip netns add' failed: {added.stderr.strip()}")
        self._made.append(self.a)
        try:
            _ip("netns", "add", self.b)
            self._made.append(self.b)
            _ip("link", "add", self.veth_a, "netns", self.a, "type", "veth", "peer", "name",
                self.veth_b, "netns", self.b)
            for ns, dev, ip in ((self.a, self.veth_a, self.ip_a),
                                (self.b, self.veth_b, self.ip_b)):
                _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            try:
                in_netns(self.b, lambda: None)
            except OSError as exc:
                raise Unavailable(f"cannot enter a network namespace: {exc}") from None
            for port in redis_ports:  # the holder's 127.0.0.1:R is Redis's
                listener = in_netns(self.a, lambda p=port: socket.create_server(  # type: ignore[misc]
                    ("127.0.0.1", p)))
                self._relays.append(FaultProxy(port, port, seed=0, listener=listener))
            self._relays.append(FaultProxy(  # and the host's 127.0.0.1:M its metrics
                metrics_port, metrics_port, seed=0, dial=lambda: in_netns(
                    self.a, lambda: socket.create_connection(("127.0.0.1", metrics_port),
                                                             timeout=2))))
        except BaseException:
            self.close()
            raise

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a process in the holder's namespace."""
        return ["ip", "netns", "exec", self.a]

    @property
    def listen(self) -> str:
        return f"tcp://{self.ip_a}:{self.holder_port}"

    def dial(self) -> socket.socket:
        """A connection to the holder, over the link (from namespace ``b``)."""
        return in_netns(self.b, lambda: socket.create_connection(
            (self.ip_a, self.holder_port), timeout=1.0))

    def cut(self) -> bool:
        """Set the holder's end of the link down; True when the kernel says it is."""
        _ip("-n", self.a, "link", "set", self.veth_a, "down")
        shown = _ip("-n", self.a, "-o", "link", "show", "dev", self.veth_a).stdout
        return "state DOWN" in shown

    def received(self) -> int:
        """Bytes that reached the consumers' end of the link so far (kernel counter)."""
        shown = _ip("-j", "-s", "-n", self.b, "link", "show", "dev", self.veth_b).stdout
        return int(json.loads(shown)[0]["stats64"]["rx"]["bytes"])

    def heal(self) -> None:
        _ip("-n", self.a, "link", "set", self.veth_a, "up")

    def close(self) -> None:
        """Stop the relays and delete both namespaces (the veth pair goes with them)."""
        for relay in self._relays:
            relay.close()
        self._relays.clear()
        for ns in reversed(self._made):
            with contextlib.suppress(OSError, subprocess.SubprocessError):  # no ip, a hang
                _ip("netns", "del", ns, check=False)
        self._made.clear()

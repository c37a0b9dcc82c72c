"""The holder's side of the one-sided NIXL read path: memory other nodes may read.

An :class:`Exporter` registers the caller's memory regions (the block pool's) with a
NIXL agent and hands out that agent's metadata blob; a reader loads the blob and reads
the regions directly, without a request to this node (see
:class:`~p2pkv.nixl.importer.Importer`).

"One-sided" needs this side to make progress all the same. Over ``UCX_TLS=tcp,self``,
UCX emulates a remote read with messages: each read completes only while the holder's
UCX worker is progressed; with the default transports on one host the data moves by
``process_vm_readv`` (CMA), but the first read still waits for one round of the
holder's progress (the connection's wireup). NIXL's own progress thread would do it,
but its Python wrapper fixes the thread's delay at 0, so it spins a whole core. Here a
dedicated daemon thread owns the agent (a NIXL agent must not be used from two threads)
and progresses it with ``get_new_notifs()`` every ``idle`` seconds. At the default 0.5 ms,
measured on a 2-core VM: a 16-byte read over TCP takes about 0.6 ms (10 µs over CMA),
and the idle thread uses 3 to 7 % of one core.

The exporter also registers a private 16-byte nonce of its own: a reader that reads
it back through NIXL and echoes it proves that its reads reach this process's memory.

Memory: the caller owns the regions and keeps them mapped until :meth:`Exporter.close`
returned (after it, they are deregistered and the agent is gone).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

from p2pkv.nixl.agent import NixlUnavailable, new_agent

__all__ = ["NONCE_BYTES", "Exporter"]

log = logging.getLogger("p2pkv.nixl")

NONCE_BYTES: Final = 16
#: Seconds __init__ waits for the thread's agent (the first one in a process takes
#: about half a second: UCX initialisation).
_READY_TIMEOUT_S: Final = 30.0
#: Seconds close() waits for the thread to deregister and drop its agent.
_CLOSE_TIMEOUT_S: Final = 10.0


class Exporter:
    """The holder's side: memory regions registered with an agent that a dedicated
    thread owns and keeps progressing.

    ``name`` is the agent's name, unique among the agents a reader loads (the node
    passes ``p2pkv-<node id hex>``); ``regions`` are ``(address, size)`` pairs of memory
    the caller owns and keeps mapped until :meth:`close` returned. ``idle`` is the
    thread's sleep between two rounds of progress (seconds).

    Ready when the constructor returns: ``metadata`` is the blob a reader loads
    (:meth:`Importer.add_peer <p2pkv.nixl.importer.Importer.add_peer>`), ``nonce`` and
    ``nonce_address`` the private nonce it can read. NixlUnavailable when the agent
    could not be made or the memory not registered (the message says why).
    """

    #: Why the thread could not start (set by the thread before it signals ready).
    _failure: str | None = None

    def __init__(self, name: str, regions: Sequence[tuple[int, int]], *,
                 idle: float = 0.0005) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("an exporter needs a non-empty agent name")
        if not idle > 0:
            raise ValueError(f"idle must be a positive number of seconds, got {idle!r}")
        spans = tuple((int(address), int(size)) for address, size in regions)
        for address, size in spans:
            if address <= 0 or size <= 0 or address + size > 1 << 64:
                raise ValueError(f"region ({address:#x}, {size}) is not a memory range")
        self.name = name
        self.regions: tuple[tuple[int, int], ...] = spans
        self.nonce = os.urandom(NONCE_BYTES)
        # Memory this object owns; registered with the regions, never written again.
        self._nonce_memory = (ctypes.c_char * NONCE_BYTES).from_buffer_copy(self.nonce)
        self.nonce_address = ctypes.addressof(self._nonce_memory)
        self.metadata = b""
        self._idle = float(idle)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"p2pkv-nixl-export-{name}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(_READY_TIMEOUT_S):
            self._stop.set()
            self._closed = True
            raise NixlUnavailable(f"NIXL agent {name!r} was not ready within "
                                  f"{_READY_TIMEOUT_S:g} s")
        if self._failure is not None:
            self._closed = True
            self._thread.join(_CLOSE_TIMEOUT_S)
            raise NixlUnavailable(self._failure)

    @property
    def closed(self) -> bool:
        return self._closed

    def _run(self) -> None:
        """The thread: make the agent, register, then progress until close()."""
        agent: Any = None
        registered: Any = None
        try:
            agent = new_agent(self.name)
            pieces = [(address, size, 0, "") for address, size in self.regions]
            pieces.append((self.nonce_address, NONCE_BYTES, 0, ""))
            registered = agent.register_memory(pieces, "DRAM")
            self.metadata = bytes(agent.get_agent_metadata())
        except Exception as exc:
            self._failure = (str(exc) if isinstance(exc, NixlUnavailable) else
                             f"cannot register memory with NIXL agent {self.name!r}: "
                             f"{type(exc).__name__}: {exc}")
            if registered is not None:
                with contextlib.suppress(Exception):
                    agent.deregister_memory(registered)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._progress(agent)
        finally:
            with contextlib.suppress(Exception):
                agent.deregister_memory(registered)
            # The last reference: the agent (its UCX worker and endpoints) is destroyed
            # here, on the thread that used it.
            agent = None

    def _progress(self, agent: Any) -> None:
        """Progress the agent every ``idle`` seconds until close(). A failing round is
        logged once (and the loop goes on: a reader's failure must not stop the
        others)."""
        stopping = self._stop.is_set
        progress = agent.get_new_notifs
        sleep = time.sleep
        idle = self._idle
        warned = False
        while not stopping():
            try:
                progress()
            except Exception as exc:
                if not warned:
                    warned = True
                    log.warning("NIXL agent %s: progress failed (%s: %s); still trying",
                                self.name, type(exc).__name__, exc)
            sleep(idle)

    def close(self) -> None:
        """Stop the thread, deregister the memory and drop the agent (idempotent).

        Waits up to 10 s for the thread; once it returned, the regions are no longer
        registered and the caller may unmap them.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(_CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # pragma: no cover - the loop wakes every `idle`
            log.warning("NIXL agent %s: its thread did not end within %g s", self.name,
                        _CLOSE_TIMEOUT_S)

    def __repr__(self) -> str:
        return (f"Exporter({self.name!r}, regions={len(self.regions)}, "
                f"closed={self._closed})")

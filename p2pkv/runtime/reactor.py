"""The IO thread: one poller, a wake-up pipe, a command queue, the deadline timer.

Threading model: a :class:`Reactor` owns one background thread. Every ZeroMQ socket of a
node lives on it and is touched by no other thread. API threads never touch a socket:
they :meth:`Reactor.submit` a command (a callable) and wake the thread through a pipe;
the command runs on the IO thread and reports on a :class:`concurrent.futures.Future`.

One loop turn: poll (its timeout from the participants: 0 while a send is ready, a short
tick while sent blocks wait for release, else the next deadline; with none, it sleeps
until a socket or the wake-up pipe says there is something to do: every command, and the
close, write to the pipe), run every queued
command, call the handler of every readable socket (in registration order), let each
participant do its after-IO work (send blocks, release sent ones), and every
:data:`~p2pkv.runtime.tuning.DEADLINE_CHECK_S` check deadlines.

The participants (the client and server sides) plug in through :class:`Participant`;
the reactor knows nothing of p2pkv messages.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

import zmq

from p2pkv.errors import P2PKVError, PeerGone
from p2pkv.runtime.tuning import DEADLINE_CHECK_S
from p2pkv.transport import Wakeup

__all__ = ["Participant", "Reactor", "fail", "resolve"]

log = logging.getLogger("p2pkv.node")

Handler = Callable[[float], None]
Pollable = zmq.Socket[bytes] | socket.socket
"""What the IO loop watches: a ZeroMQ socket, or a plain socket (a data stream)."""


class Participant(Protocol):
    """One side of the node as the IO loop drives it. All calls run on the IO thread."""

    def after_io(self, now: float) -> None:
        """Work after the readable sockets were handled (send what may be sent)."""

    def busy_wait_ms(self) -> int | None:
        """The longest poll wait while this side has work pending, or None when idle."""

    def next_deadline(self) -> float | None:
        """The earliest deadline of this side, or None."""

    def check_deadlines(self, now: float) -> None:
        """Fail or poll whatever is due at ``now``."""

    def idle(self) -> bool:
        """True when nothing is in flight (a graceful close may finish)."""

    def shutdown(self) -> None:
        """Tell peers bye, fail every waiter, close this side's sockets."""


class Reactor:
    """The node's IO thread and everything that runs it."""

    def __init__(self, name: str) -> None:
        self._name = name
        # (future, command): a command that never runs (the node closed first) fails
        # its future, so every future a caller holds completes.
        self._commands: queue.SimpleQueue[tuple[Future[Any], Callable[[], None]]] = (
            queue.SimpleQueue())
        # Guards "still accepting commands" together with the enqueueing, so that no
        # command slips into the queue after the IO thread drained it for the last time.
        self._accept_lock = threading.Lock()
        self._accepting = True
        self._wakeup = Wakeup()
        self._poller = zmq.Poller()
        self._poller.register(self._wakeup.fileno(), zmq.POLLIN)
        self._handlers: dict[zmq.Socket[bytes] | int, Handler] = {}
        self._participants: list[Participant] = []
        self._on_exit: Callable[[], None] = lambda: None
        self._closing = False
        self._close_deadline = 0.0
        self._next_deadline_check = 0.0
        #: Set once the IO thread released everything (or close gave up waiting on it).
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- wiring (before start, or on the IO thread) ------------------------------------

    def add(self, participant: Participant) -> None:
        """Drive ``participant``; participants are called in the order they were added."""
        self._participants.append(participant)

    def register(self, sock: Pollable, handler: Handler, *, writable: bool = False) -> None:
        """Call ``handler(now)`` whenever ``sock`` is readable, or also writable when
        ``writable`` (IO thread only; a plain socket must be unregistered before it is
        closed)."""
        key = _key(sock)
        self._handlers[key] = handler
        self._poller.register(key, zmq.POLLIN | (zmq.POLLOUT if writable else 0))

    def watch_writable(self, sock: Pollable, writable: bool) -> None:
        """Whether ``sock``'s handler also runs when it is writable (registered only)."""
        key = _key(sock)
        if key in self._handlers:
            self._poller.modify(key, zmq.POLLIN | (zmq.POLLOUT if writable else 0))

    def unregister(self, sock: Pollable) -> None:
        key = _key(sock)
        self._handlers.pop(key, None)
        with contextlib.suppress(KeyError, zmq.ZMQError):
            self._poller.unregister(key)

    def start(self, on_exit: Callable[[], None]) -> None:
        """Start the IO thread; ``on_exit`` runs on it last (release the context)."""
        self._on_exit = on_exit
        self.thread.start()

    # -- any thread ----------------------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self._closing or self.closed.is_set()

    def submit(self, fut: Future[Any], command: Callable[[], None]) -> None:
        """Run ``command`` on the IO thread; an exception it raises fails ``fut``.

        Raises :class:`PeerGone` once the node is closing. A command accepted here
        either runs, or (the node closed before it could) fails ``fut`` with
        :class:`PeerGone`.
        """

        def guarded() -> None:
            try:
                command()
            except Exception as exc:  # report on the future, never kill the IO thread
                if not isinstance(exc, (P2PKVError, ValueError)):
                    log.exception("command failed")
                fail(fut, exc)

        with self._accept_lock:
            if not self._accepting or self.closing:
                raise PeerGone("node is closed")
            self._commands.put((fut, guarded))
        self._wakeup.notify()

    def begin_close(self, deadline: float) -> bool:
        """Any thread: accept no more commands; the IO thread stops once idle, or at
        ``deadline`` at the latest. False when the close had already begun."""
        with self._accept_lock:
            if not self._accepting:
                return False
            self._accepting = False
            self._close_deadline = deadline
            self._closing = True
        self._wakeup.notify()
        return True

    # -- the IO thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # pragma: no cover - a bug; make it loud, fail every waiter
            log.exception("IO thread crashed")
        finally:
            self._shutdown()

    def _loop(self) -> None:
        participants = self._participants
        while True:
            now = time.monotonic()
            if self._closing and (all(p.idle() for p in participants)
                                  or now >= self._close_deadline):
                return
            ready = dict(self._poller.poll(self._poll_timeout(now)))
            now = time.monotonic()
            if self._wakeup.fileno() in ready:
                self._wakeup.drain()
            self._run_commands()
            for sock in list(ready):
                handler = self._handlers.get(sock)  # the wake-up pipe has none
                if handler is not None:
                    handler(now)
            for p in participants:
                p.after_io(now)
            now = time.monotonic()
            # Deadlines are coarse (heartbeats, request timeouts); checking them on
            # every message would cost more than the messages themselves.
            if now >= self._next_deadline_check:
                self._next_deadline_check = now + DEADLINE_CHECK_S
                for p in participants:
                    p.check_deadlines(now)

    def _poll_timeout(self, now: float) -> int:
        busy = [ms for ms in (p.busy_wait_ms() for p in self._participants) if ms is not None]
        if busy:
            return min(busy)
        deadlines = [d for d in (p.next_deadline() for p in self._participants)
                     if d is not None]
        if self._closing:
            deadlines.append(self._close_deadline)
        soonest = min(deadlines, default=math.inf)
        if soonest == math.inf:
            return -1  # nothing is due: a socket or the wake-up pipe wakes the loop
        return int(max(0.0, soonest - now) * 1000) + 1

    def _run_commands(self) -> None:
        while True:
            try:
                _, command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _shutdown(self) -> None:
        with self._accept_lock:
            self._accepting = False
            self._closing = True
        for p in self._participants:
            try:
                p.shutdown()
            except Exception:  # pragma: no cover - a bug; the others must still close
                log.exception("shutdown of %s failed", type(p).__name__)
        # Commands accepted but never run: their callers are told, not left waiting.
        gone = PeerGone("node closed before the request could start")
        while True:
            try:
                fut, _ = self._commands.get_nowait()
            except queue.Empty:
                break
            fail(fut, gone)
        self._wakeup.close()
        self._on_exit()
        self.closed.set()


def _key(sock: Pollable) -> zmq.Socket[bytes] | int:
    """How the poller names a socket: a ZeroMQ socket by itself, a plain one by its
    descriptor (what ``zmq.Poller.poll`` returns for it)."""
    return sock.fileno() if isinstance(sock, socket.socket) else sock


def resolve(fut: Future[Any], value: Any) -> None:
    """Set ``fut``'s result unless it is already done (cancelled by its caller, failed)."""
    if not fut.done():
        with contextlib.suppress(InvalidStateError):
            fut.set_result(value)


def fail(fut: Future[Any], exc: BaseException) -> None:
    """Fail ``fut`` unless it is already done (cancelled by its caller, resolved)."""
    if not fut.done():
        with contextlib.suppress(InvalidStateError):
            fut.set_exception(exc)

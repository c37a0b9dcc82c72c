"""The node's tuning constants, in one place (the benchmark imports them from here).

None of these is a protocol rule; they trade latency against CPU on the IO thread. The
IO loop waits on events (its sockets, its wake-up pipe, its deadlines); the few fixed
waits below exist where nothing can be waited on, and each says why.
Deadlines that users may want to change are in :class:`~p2pkv.runtime.config.NodeConfig`.
"""

from __future__ import annotations

from typing import Final

from p2pkv.protocol.flow import BATCH_BYTES

__all__ = [
    "BATCH_BYTES",
    "BYE_FLUSH_S",
    "DEADLINE_CHECK_S",
    "DRAIN_FLUSH_MS",
    "DRAIN_SETTLE_S",
    "LATENCY_BUCKETS",
    "MONITOR_GRACE_MS",
    "READ_BUDGET",
    "READ_BURST_BYTES",
    "REAP_TICK_MS",
    "STOP_WAIT_S",
    "WAIT_GRACE",
    "WAKE_BYTES",
    "ZERO_COPY_MIN",
]

READ_BUDGET: Final = 256
"""Messages handled per socket per loop turn, so one busy peer cannot starve the others."""

REAP_TICK_MS: Final = 10
"""Poll tick while sent blocks wait for ZeroMQ to release them: a tick, because nothing
can be waited on. pyzmq reports a zero-copy frame let go by setting a
``threading.Event`` (its ``MessageTracker``) from its garbage-collector thread, not on a
descriptor the IO loop can poll. 10 ms keeps a pinned block at most about one tick
longer than libzmq needs it, at a cost of 100 idle wake-ups a second, and only while
blocks are in flight (otherwise the loop sleeps until a socket, the wake-up pipe or a
deadline)."""

DEADLINE_CHECK_S: Final = 0.005
"""How often the IO loop checks deadlines while it is busy (it always checks when idle)."""

READ_BURST_BYTES: Final = 4 << 20
"""Block bytes received per connection per loop turn before commands get a turn."""

WAKE_BYTES: Final = 2 << 20
"""A data stream in the middle of a message wakes the IO thread once this many of the
message's bytes are there (``SO_RCVLOWAT``), or all that is left of it."""

WAIT_GRACE: Final = 1.0
"""Grace added to a blocking helper's wait beyond the IO thread's own deadline, so the
typed timeout from the IO thread wins over a bare ``concurrent.futures`` timeout."""

LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                          5.0, 10.0, 30.0, float("inf"))
"""Upper bounds (seconds) of the fetch latency histogram."""

MONITOR_GRACE_MS: Final = 100
"""How long a failed pre-handshake send waits for the monitor to explain it. A wait on
the monitor socket, not a sleep: it ends as soon as libzmq reports the security
handshake's failure, so the caller gets a
:class:`~p2pkv.errors.TransportHandshakeFailed` saying why rather than a bare PeerGone.
100 ms covers a busy host's scheduling delay and stays small next to any
handshake timeout; it is spent only when no event comes (a send failed for another
reason)."""

ZERO_COPY_MIN: Final = 65536
"""Segments at least this large are sent zero-copy (tracked); smaller ones are cheaper to
copy into libzmq than to track (pyzmq's own copy threshold is of the same order)."""

DRAIN_SETTLE_S: Final = 0.5
"""How long a draining node stays up after its last fetch was handed to ZeroMQ, so that
the consumers take the tail before the connection goes (within the drain deadline). A
sleep, because nothing can be waited on: neither ZeroMQ nor the protocol says when the
peer has read a message (a fetch's ``done`` gets no answer). Half a second is many
times what a consumer on the same network takes to read a window of blocks, and short
next to a drain's deadline (``drain_timeout``, 10 s by default); the router's
:data:`DRAIN_FLUSH_MS` linger then covers what is still in the kernel."""

BYE_FLUSH_S: Final = 0.25
"""How long a peer's TCP connection outlives the ``bye`` that ended its session when
the connection must be cut too (its data stream failed): libzmq writes the ``bye`` to
the kernel first, so the peer learns why (cutting at once lost it about two times in
three). A deadline of the IO loop, not a sleep: libzmq says nothing of when the message
left its queue, so the cut waits a bound instead: far above what a small message takes to
reach the kernel, and short enough that a peer whose stream failed holds its
connection only briefly."""

DRAIN_FLUSH_MS: Final = 1000
"""How long a draining node's ROUTER lingers at close so that ZeroMQ hands the last
blocks of the fetches it finished (and its byes) to the kernel; otherwise LINGER 0."""

STOP_WAIT_S: Final = 5.0
"""How long stopping a helper waits for it (a metrics server's thread, a Redis
registration's thread, a worker process being reaped) before it goes on: each is told
to stop first, so the wait only bounds one that does not."""

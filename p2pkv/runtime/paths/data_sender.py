"""The serving side of ``tcp-data-v1``, once a stream is bound: its sends.

A stream the data port bound to a peer's session (:mod:`p2pkv.runtime.paths.data_server`)
is a :class:`BoundStream`. It carries the ``block`` and ``done`` messages of the peer's
fetches that are not served through shared memory (:class:`StreamOut`, the ``stream``
kind of :mod:`p2pkv.runtime.paths`): :class:`DataSender` pins a batch within the
fetch's credit, queues its header and the slots' segments, and ``sendmsg`` gathers them
straight from the pool; each block stays pinned until its last byte went to the kernel
(or the stream is dropped). The client sends nothing on the stream after its preface: a
byte from it, the end of the stream or a failed write ends the peer's session, like the
end of its ZeroMQ connection.

IO thread only.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Final, Protocol

from p2pkv import protocol as proto
from p2pkv.protocol.codes import OUTCOME_SENT
from p2pkv.runtime.paths.interfaces import Sending
from p2pkv.runtime.paths.sender import pin_next_slots
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.stats import SENT, Count, Counters
from p2pkv.store import BlockStore
from p2pkv.transport.datachannel import RETRY, Gather

__all__ = ["BoundStream", "DataSender", "StreamOut", "StreamOwner"]

log = logging.getLogger("p2pkv.node")

_QUEUE_MESSAGES: Final = 2
"""Stream messages queued ahead of the kernel per peer: enough to keep its socket
buffer full, few enough that pins are short and a new fetch's first blocks go out soon."""


class StreamOwner(Protocol):
    """The peer a token was offered to (an inbound connection)."""

    closed: bool

    def wants_stream(self, index: int) -> bool:
        """Whether its stream ``index`` may bind now (its session negotiated the stream,
        and that one is not bound yet)."""

    def stream_form(self) -> str | None:
        """How its session's streams are protected (``"plain"``, ``"tls"``,
        ``"sealed"``: :func:`p2pkv.protocol.stream_form`), None without a stream."""

    def bind_stream(self, stream: BoundStream, index: int) -> None:
        """Its stream ``index`` arrived with the right token."""

    def stream_lost(self, code: int, why: str) -> None:
        """Its bound stream ended or failed (``code``: the close reason): the session
        ends."""


class BoundStream:
    """One bound stream: messages queued in order, written as the socket takes them.

    The peer never writes on it: readable means it closed or broke the protocol, and
    ``owner.stream_lost`` is told (once). :meth:`close` unpins whatever is queued.
    """

    def __init__(self, reactor: Reactor, sock: socket.socket, owner: StreamOwner) -> None:
        self._reactor = reactor
        self._sock = sock
        self._owner = owner
        self._gather = Gather(sock)
        self._messages = 0
        self._watching = False
        self.closed = False
        # The stall clock: bytes written so far, and since when that count has not moved
        # while bytes were queued (None: not waiting on the reader).
        self._seen_written = 0
        self._waiting_since: float | None = None
        reactor.register(sock, self._on_event)

    @property
    def has_room(self) -> bool:
        """Whether another message may be queued now."""
        return self._messages < _QUEUE_MESSAGES

    @property
    def busy(self) -> bool:
        """Whether bytes are still queued for the kernel."""
        return bool(self._gather)

    def stalled_for(self, now: float) -> float:
        """Seconds the reader has taken no byte while some were queued for it (0 when
        nothing waits or bytes moved since the last call). The peer's connection polls
        it against its send deadline: a consumer that stops reading its stream but keeps
        answering pings would otherwise pin its fetch's blocks for ever."""
        written = self._gather.written_bytes
        if not self._gather or written != self._seen_written:
            self._seen_written = written
            self._waiting_since = now if self._gather else None
            return 0.0
        if self._waiting_since is None:
            self._waiting_since = now
        return now - self._waiting_since

    def push(self, head: bytes, segments: list[memoryview] | None = None,
             done: Callable[[], None] | None = None) -> None:
        """Queue frame 0 ``head`` (and a block message's segments, in order; ``done``
        runs once they are written or dropped)."""
        buffers = [memoryview(proto.frame_prefix(head) + head)]
        if segments:
            buffers.extend(segments)
        self._messages += 1

        def written() -> None:
            self._messages -= 1
            if done is not None:
                done()

        self._gather.push(buffers, written)

    def flush(self) -> None:
        """Write what the socket takes; watch for room when something is left."""
        if self.closed:
            return
        try:
            empty = self._gather.flush()
        except OSError as exc:
            self._lost(proto.Code.NORMAL_CLOSE, f"writing the data stream failed: {exc}")
            return
        if empty == self._watching:
            self._watching = not empty
            self._reactor.watch_writable(self._sock, self._watching)

    def _on_event(self, now: float) -> None:
        if self.closed:
            return
        try:
            self._read_or_write()
        except Exception as exc:
            # A bug must cost one peer, never the node (or its IO thread).
            log.exception("internal error on a data stream")
            self._lost(proto.Code.NORMAL_CLOSE, f"internal error on the data stream: {exc!r}")

    def _read_or_write(self) -> None:
        try:
            data = self._sock.recv(1)
        except RETRY:
            self.flush()
            return
        except OSError as exc:
            self._lost(proto.Code.NORMAL_CLOSE, f"the data stream failed: {exc}")
            return
        if data:
            self._lost(proto.Code.PROTOCOL_VIOLATION,
                       "the peer wrote on its data stream after the preface")
        else:
            self._lost(proto.Code.NORMAL_CLOSE, "the peer closed its data stream")

    def _lost(self, code: int, why: str) -> None:
        self.close()
        self._owner.stream_lost(code, why)

    def close(self) -> None:
        """Drop the stream: everything queued is unpinned, the socket closed."""
        if self.closed:
            return
        self.closed = True
        self._reactor.unregister(self._sock)
        self._gather.drop()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class DataSender:
    """Sends served fetches' blocks on bound streams, within each fetch's credit."""

    def __init__(self, store: BlockStore, segments: tuple[int, ...], bytes_per_block: int,
                 counters: Counters) -> None:
        self._store = store
        self._bpb = bytes_per_block
        self._counters = counters
        self._batch_limit = proto.stream_batch_limit(bytes_per_block, len(segments))

    def send_job(self, session: proto.Session, job: Sending, stream: BoundStream) -> None:
        """Queue what the credit of ``job`` and the stream's queue allow, then write."""
        store = self._store
        n = len(job.keys)
        checksums = session.checksums
        credit = session.window_left(job.req)
        views = store.pool.slot_views
        while credit > 0 and job.next_index < n and stream.has_room and not stream.closed:
            idx, slots = pin_next_slots(store, job, credit, self._batch_limit)
            credit -= len(idx)
            if not idx:
                continue
            unpin = self._unpin(slots)
            try:
                sums = store.slots.checksums(slots) if checksums else None
                head = proto.encode_head(session.block(job.req, idx, sums))
                segments: list[memoryview] = []
                for slot in slots:
                    segments += views(slot)
                stream.push(head, segments, unpin)
            except BaseException:
                unpin()  # whatever went wrong, or the blocks stay pinned forever
                raise
            for i in idx:
                job.outcomes[i] = OUTCOME_SENT
            self._counters.add(Count.BLOCKS_SENT, len(idx))
            self._counters.add(Count.BYTES_SENT, len(idx) * self._bpb)
            self._counters.moved("stream", SENT, len(idx), len(idx) * self._bpb)
        stream.flush()

    def _unpin(self, slots: list[int]) -> Callable[[], None]:
        """Release the pins of ``slots`` once, however many times it is called (written,
        or dropped, or given up when queueing failed)."""
        store = self._store
        held = [slots]

        def unpin() -> None:
            if held:
                store.slots.unpin(held.pop())

        return unpin


class StreamOut:
    """The serving half of ``tcp-data-v1`` for one peer: its bound stream carries the
    blocks and the ``done`` of every fetch that arrived once it was bound."""

    kind = "stream"

    def __init__(self, sender: DataSender, stream: BoundStream) -> None:
        self._sender = sender
        self.stream = stream

    def can_send(self, session: proto.Session, job: Sending) -> bool:
        return self.stream.has_room

    def send(self, session: proto.Session, job: Sending) -> bool:
        # A failed write ends the stream, and its owner's session with it.
        self._sender.send_job(session, job, self.stream)
        return True

    def finish(self, session: proto.Session, job: Sending) -> bool:
        # The done follows the fetch's last block on the same stream (SPEC §18).
        self.stream.push(proto.encode_head(session.fetch_done(job.req, job.outcomes)))
        self.stream.flush()
        return True

    def abort(self, req: int) -> None:
        pass  # what is queued goes out; the client discards a fetch it aborted

    def stalled_for(self, now: float) -> float:
        return self.stream.stalled_for(now)

    @property
    def busy(self) -> bool:
        return self.stream.busy

    def close(self) -> None:
        self.stream.close()  # unpins what it still queued

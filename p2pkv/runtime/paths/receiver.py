"""The fetching side's data path: blocks land with ``recv_into``, verified, per key.

A block message is a header frame then one frame per segment of each block. Each
segment is received with ``recv_into`` straight into its destination: a slot of the
local store that lookups cannot see yet (:class:`~p2pkv.store.BlockWriter`), or a
caller-owned buffer (``fetch_into``). Payload bytes are never copied in Python. A block
becomes visible only after its last segment landed and, when checksums were negotiated,
its xxh3-64 matched; a failed block releases its slot and is reported per key (both
settled by :class:`~p2pkv.runtime.paths.landing.Landing`, as for the other ways of landing).
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from p2pkv import protocol as proto
from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import OUTCOME_FAILED, OUTCOME_MISSING, OUTCOME_SENT
from p2pkv.runtime.paths.landing import Landed, Landing
from p2pkv.runtime.paths.packing import PackedReceiver
from p2pkv.runtime.public import FetchResult, KeyOutcome
from p2pkv.runtime.state import Receiving
from p2pkv.runtime.stats import Counters

__all__ = ["Receiver", "check_destinations", "drain"]

# Sink for payload frames that have nowhere to go (aborted fetch, failed slot).
_SCRATCH = bytearray(0)


def drain(sock: zmq.Socket[bytes]) -> None:
    """Drop the rest of a multipart message."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(zmq.NOBLOCK)


def check_destinations(destinations: Sequence[Sequence[object]], nkeys: int,
                       segments: Sequence[int]) -> list[list[memoryview]]:
    """Caller-owned destination buffers as byte views; ``ValueError`` naming the first
    one that is not a writable buffer of its segment's size."""
    if len(destinations) != nkeys:
        raise ValueError(f"destinations has {len(destinations)} entries for {nkeys} keys")
    checked: list[list[memoryview]] = []
    for i, bufs in enumerate(destinations):
        if len(bufs) != len(segments):
            raise ValueError(f"destinations[{i}] has {len(bufs)} buffers, the layout has "
                             f"{len(segments)} segments")
        views = []
        for j, buf in enumerate(bufs):
            view = memoryview(buf).cast("B")  # type: ignore[arg-type]
            if view.readonly or view.nbytes != segments[j]:
                raise ValueError(f"destinations[{i}][{j}] must be a writable buffer of "
                                 f"{segments[j]} bytes, got {view.nbytes} "
                                 f"({'read-only' if view.readonly else 'writable'})")
            views.append(view)
        checked.append(views)
    return checked


class Receiver:
    """Lands block messages and turns a finished fetch into its :class:`FetchResult`."""

    def __init__(self, landing: Landing, segments: Sequence[int], bytes_per_block: int,
                 counters: Counters) -> None:
        self._landing = landing
        self._segments = tuple(segments)
        self._counters = counters
        self._packed = PackedReceiver(landing, segments, bytes_per_block)

    def land(self, sock: zmq.Socket[bytes], recv: Receiving | None,
             msg: proto.BlockArrived) -> int:
        """recv_into each payload frame of ``msg`` directly into its destination (None:
        read and drop them); the blocks landed.

        The session has already checked the header (known fetch, fresh indices, within
        the granted window, checksum presence as negotiated). Raises the framing
        violation when the message does not carry the frames it announced.
        """
        with self._landing.guard():
            if msg.packed:
                return self._packed.land(sock, recv, msg)
            return self._land(sock, recv, msg)

    def _land(self, sock: zmq.Socket[bytes], recv: Receiving | None,
              msg: proto.BlockArrived) -> int:
        landing = self._landing
        landed = 0
        segments = self._segments
        nseg = len(segments)
        for n, idx in enumerate(msg.idx):
            block: Landed | None = None
            key_index = -1
            if recv is not None and idx < len(recv.index_map):
                key_index = recv.index_map[idx]
                block = landing.open(recv, key_index, msg.sums[n])
            # libzmq delivers a multipart message whole, so one "more frames?" check
            # per block suffices: a message that ends early shows up as a frame of the
            # wrong size, as nothing left to read, or as surplus frames at the end —
            # each a violation that closes the connection.
            intact = bool(sock.getsockopt(zmq.RCVMORE))
            if intact:
                try:
                    for s in range(nseg):
                        if block is not None:
                            if sock.recv_into(block.views[s], flags=zmq.NOBLOCK) != segments[s]:
                                intact = False
                        else:
                            sock.recv_into(_SCRATCH, flags=zmq.NOBLOCK)
                except zmq.Again:
                    raise ProtocolError(proto.Code.FRAME_COUNT, "block message carries "
                                        "fewer frames than announced") from None
            if recv is None or key_index < 0:
                continue
            if not intact:
                if block is not None and block.writer is not None:
                    block.writer.abort()
                landing.fail(recv, key_index, "payload frames do not match the block geometry")
            elif block is not None:
                landed += landing.settle(recv, block)
        if sock.getsockopt(zmq.RCVMORE):
            drain(sock)
            raise ProtocolError(proto.Code.FRAME_COUNT,
                                "block message carries more frames than announced")
        return landed

    def finish(self, recv: Receiving, wire: Sequence[int], now: float) -> FetchResult | None:
        """The result of a fetch the peer reported done: a key with no outcome yet gets
        the peer's (missing, or failed with the reason). A part of a striped fetch
        (p2pkv.runtime.paths.lanes) gives None until it is the last one done."""
        if None in recv.outcomes:  # else every key has its outcome (no step per key)
            for pos, key_index in enumerate(recv.index_map):
                if recv.outcomes[key_index] is not None:
                    continue
                code = wire[pos] if pos < len(wire) else OUTCOME_FAILED
                if code == OUTCOME_MISSING:
                    recv.outcomes[key_index] = KeyOutcome.MISSING
                else:
                    recv.outcomes[key_index] = KeyOutcome.FAILED
                    recv.errors.setdefault(key_index, "peer reported the block as sent but it "
                                           "never arrived" if code == OUTCOME_SENT
                                           else "peer failed to send the block")
        parts = [recv] if recv.group is None else recv.group
        if recv.group is not None:
            recv.done = True
            if not all(r.done for r in parts):
                return None
        for again, first in recv.repeats:
            recv.outcomes[again] = recv.outcomes[first]
            if first in recv.errors:
                recv.errors[again] = recv.errors[first]
        seconds = now - recv.started
        self._counters.fetch_finished(seconds)
        outcomes = recv.outcomes
        return FetchResult(recv.keys, tuple(outcomes)  # type: ignore[arg-type]
                           if None not in outcomes else
                           tuple(o or KeyOutcome.FAILED for o in outcomes),
                           dict(recv.errors), sum(r.blocks for r in parts),
                           sum(r.nbytes for r in parts), seconds)

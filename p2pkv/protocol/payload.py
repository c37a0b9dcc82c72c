"""The payload frames of a ``block``: how many, and of which sizes (``protocol/SPEC.md``
§4.8, and §17 for a packed block). Used by :mod:`p2pkv.protocol.codec`; pure."""

from __future__ import annotations

from collections.abc import Sequence

from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import MAX_PACKED_BYTES, MAX_PAYLOAD_FRAMES, MAX_SEGMENTS, Code
from p2pkv.protocol.messages import Block, Frame

__all__ = ["check_block_frames", "check_payload_sizes", "frame_size", "segments_for"]


def frame_size(frame: Frame) -> int:
    """Size of a frame in bytes (a memoryview's ``nbytes``, not its item count).

    Raises :class:`~p2pkv.errors.ProtocolError` (``MALFORMED``) for a non-buffer.
    """
    kind = type(frame)
    if kind is bytes or kind is bytearray:
        return len(frame)
    try:
        return memoryview(frame).nbytes
    except TypeError:
        raise ProtocolError(
            Code.MALFORMED, f"a frame must be bytes-like, got {kind.__name__}"
        ) from None


def segments_for(block: Block, segments: Sequence[int]) -> tuple[int, ...]:
    """The size of each payload frame of ``block``, in wire order (block-major); a packed
    block has one frame of all its blocks' bytes."""
    if block.pk:
        return (sum(segments) * len(block.idx),)
    return tuple(segments) * len(block.idx)


def check_block_frames(msg: Block, more_frames: int | None,
                       segments: Sequence[int] | None) -> None:
    """The frame count of a ``block`` (``more_frames`` payload frames, when known) against
    its header and the negotiated ``segments`` (None before the handshake)."""
    blocks = len(msg.idx)
    if msg.pk:
        if segments is not None and blocks * sum(segments) > MAX_PACKED_BYTES:
            raise ProtocolError(
                Code.OUT_OF_BOUNDS,
                f"block: {blocks} packed block(s) of {sum(segments)} bytes exceed "
                f"{MAX_PACKED_BYTES} bytes in one frame",
            )
        if more_frames is not None and more_frames != 1:
            raise ProtocolError(
                Code.FRAME_COUNT,
                f"block: a packed block message has exactly one payload frame, got "
                f"{more_frames}",
            )
        return
    per_block = None if segments is None else len(segments)
    if per_block is not None and blocks * per_block > MAX_PAYLOAD_FRAMES:
        raise ProtocolError(
            Code.OUT_OF_BOUNDS,
            f"block: {blocks} blocks × {per_block} segments exceed "
            f"{MAX_PAYLOAD_FRAMES} payload frames",
        )
    if more_frames is None:
        return
    if per_block is not None:
        if more_frames != blocks * per_block:
            raise ProtocolError(
                Code.FRAME_COUNT,
                f"block: {blocks} block(s) × {per_block} segment(s) need "
                f"{blocks * per_block} payload frames, got {more_frames}",
            )
        return
    if more_frames < blocks or more_frames % blocks or more_frames // blocks > MAX_SEGMENTS:
        raise ProtocolError(
            Code.FRAME_COUNT,
            f"block: {more_frames} payload frames is not 1..{MAX_SEGMENTS} per block "
            f"for {blocks} block(s)",
        )


def check_payload_sizes(msg: Block, payload: Sequence[Frame],
                        segments: Sequence[int] | None) -> None:
    """Each payload frame of ``msg`` has the size of its segment (or, packed, of all its
    blocks); nothing to check before the segments are negotiated."""
    sizes = [frame_size(frame) for frame in payload]
    if segments is None:
        return
    if msg.pk:
        want = len(msg.idx) * sum(segments)
        if sizes[0] != want:
            raise ProtocolError(
                Code.FRAME_COUNT,
                f"block: the packed payload frame is {sizes[0]} bytes, {len(msg.idx)} "
                f"block(s) of {sum(segments)} bytes need {want}",
            )
        return
    per_block = len(segments)
    for i, got in enumerate(sizes):
        want = segments[i % per_block]
        if got != want:
            raise ProtocolError(
                Code.FRAME_COUNT,
                f"block: payload frame {i} (block {i // per_block}, segment "
                f"{i % per_block}) is {got} bytes, segment size is {want}",
            )

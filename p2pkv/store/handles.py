"""The handles :class:`~p2pkv.store.BlockStore` gives out on one pool slot.

A :class:`BlockWriter` is exclusive access to a slot being filled (invisible to lookup
until it commits); a :class:`BlockReader` is one pin on a committed block (its slot is
neither evicted nor reused until every reader has released it). Both alias the slot's
memory with one ``memoryview`` per segment, and both finish through the store that made
them: this module holds what a handle is; the store's book (:mod:`p2pkv.store.book`)
holds the bookkeeping (per slot: the pin count, the checksum computed once) and the
lock, and a handle's calls are wrappers of the batch slot calls
(:mod:`p2pkv.store.slots`).

:func:`split_segments` cuts a block given as one buffer into its segments (for
:meth:`~p2pkv.store.BlockStore.put`).

Handles are created only by the store; see :mod:`p2pkv.store` for the lifecycle and
the threading rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Protocol

from p2pkv.checksum import BytesLike

__all__ = ["BlockReader", "BlockWriter", "HandleOwner", "split_segments"]


class HandleOwner(Protocol):
    """What a handle finishes through: the :class:`~p2pkv.store.BlockStore` that made
    it (named by what it does, so that this module does not import the store's). It
    finishes a handle by :meth:`BlockWriter.finish` and :meth:`BlockReader.unpin`."""

    def commit_many(self, writers: Sequence[BlockWriter],
                    expected_checksums: Sequence[int | None]) -> Sequence[Exception | None]:
        ...

    def abort_write(self, writer: BlockWriter) -> None: ...

    def release_many(self, readers: Iterable[BlockReader]) -> None: ...

    def checksum_of(self, reader: BlockReader) -> int: ...


class _SlotHandle:
    """What both handles are: one slot of ``store``'s pool holding ``key``, seen through
    one memoryview per segment, and a flag the store sets once as it finishes the
    handle (see :meth:`_end`)."""

    __slots__ = ("_ended", "_store", "key", "slot", "views")

    def __init__(self, store: HandleOwner, key: bytes, slot: int,
                 views: Sequence[memoryview]) -> None:
        self._store = store
        self._ended = False
        self.key = key
        #: The pool slot.
        self.slot = slot
        #: One memoryview per segment, aliasing the pool slot.
        self.views = views

    def _end(self) -> bool:
        """True the first time, False once ended."""
        first = not self._ended
        self._ended = True
        return first


class BlockWriter(_SlotHandle):
    """Exclusive access to one slot being filled for ``key``.

    Fill :attr:`views`, then :meth:`commit` or :meth:`abort` exactly once
    (abort after either is a no-op, so ``with writer:`` aborts on error).
    Created only by :meth:`BlockStore.begin_write`.
    """

    __slots__ = ()

    @property
    def done(self) -> bool:
        """True once committed or aborted."""
        return self._ended

    def finish(self) -> bool:
        """Mark the write committed or aborted: for the store that made it, as it does
        either. True the first time, False once finished (a writer belongs to one
        thread)."""
        return self._end()

    def commit(self, expected_checksum: int | None = None) -> None:
        """Make the block visible.

        With ``expected_checksum`` the bytes are verified first (see
        :func:`block_checksum`); on mismatch the write is aborted and
        :class:`~p2pkv.store.ChecksumMismatch` raised. Raises
        :class:`~p2pkv.store.StoreError` if the writer was already committed or
        aborted.
        """
        # One commit path: a single block is a batch of one.
        (mismatch,) = self._store.commit_many((self,), (expected_checksum,))
        if mismatch is not None:
            raise mismatch

    def abort(self) -> None:
        """Release the slot; the block never existed. Idempotent."""
        self._store.abort_write(self)

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class BlockReader(_SlotHandle):
    """A pin on one committed block; its slot is not reused until released. Its
    :attr:`views` are read-only in use: do not write.

    Created only by :meth:`BlockStore.acquire_read`. :meth:`release` is
    idempotent and may be called from any thread (for example the thread that
    sees a ``zmq`` send tracker finish).
    """

    __slots__ = ()

    @property
    def released(self) -> bool:
        """True once released: its slot may hold another block since."""
        return self._ended

    def unpin(self) -> bool:
        """Mark the reader released: for the store that made it, under its book's lock,
        as it drops the pin. True the first time, False once released."""
        return self._end()

    @property
    def checksum(self) -> int:
        """:func:`block_checksum` of the block, computed once per stored block.
        :class:`~p2pkv.store.StoreError` once released: the slot may hold another block
        by then, whose checksum this must never become."""
        return self._store.checksum_of(self)

    def release(self) -> None:
        self._store.release_many((self,))

    def __enter__(self) -> BlockReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def split_segments(data: BytesLike | Sequence[BytesLike], sizes: Sequence[int],
                   bytes_per_block: int) -> list[memoryview]:
    """``data`` as one view per segment of a layout with segments ``sizes``: one buffer
    of ``bytes_per_block`` bytes (segments back to back), or one buffer per segment.
    ValueError when the sizes do not match."""
    if isinstance(data, (list, tuple)):
        parts = [memoryview(part).cast("B") for part in data]
        got = [len(part) for part in parts]
        if got != list(sizes):
            raise ValueError(f"segment sizes {got} do not match the layout's {list(sizes)}")
        return parts
    flat = memoryview(data).cast("B")  # type: ignore[arg-type]
    if len(flat) != bytes_per_block:
        raise ValueError(
            f"block data is {len(flat)} bytes, the layout needs {bytes_per_block}"
        )
    parts = []
    offset = 0
    for size in sizes:
        parts.append(flat[offset : offset + size])
        offset += size
    return parts

"""The sealed data stream's socket (``tcp-data-aead-v1``, SPEC §18.8): AES-256-GCM
records in one direction, written from and read into the stream's own buffers.

A :class:`SealedSocket` is the bound stream's socket once its preface and answer
passed: the server's seals what it writes (its ``sealer``), the client's opens what it
reads (its ``opener``); the other direction stays raw, since after the preface the
client writes nothing. The data path uses it like a plain stream
(:func:`p2pkv.transport.datachannel.sendmsg` and ``recvmsg_into`` send here):

- **Writing.** Each record is sealed straight from the caller's buffer when that buffer
  alone is large (a block's segment: no copy), else from small buffers gathered into
  one staging buffer. The caller hears of a record's bytes only once all of its
  ciphertext went to the kernel, so what it counts as written (and unpins) is always
  what the peer can get; until then it presents the same bytes again, as with TLS.
- **Reading.** A record is read whole (its length first), then opened straight into
  the caller's buffer when the record fits in it (a block's segment: no copy), else
  into a staging buffer that the next reads drain (:meth:`SealedSocket.pending`). A
  record that fails its tag ends the stream (:class:`~p2pkv.protocol.seal.SealError`);
  so does an end of the stream inside a record. Bytes opened into a slot before their
  tag was checked are in a slot no lookup can see: a block becomes visible only once
  all its bytes arrived and verified, and a failed record ends the stream first.
- **Memory.** Each direction keeps two buffers, which start at 64 KiB and grow to the
  largest record they had to hold (1 MiB at most): a stream of large segments stages
  only its headers, one of small blocks about 2 MiB per side.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, Final

from p2pkv.protocol.seal import MAX_RECORD, RECORD_HEAD, TAG_LEN, RecordKeys, SealError

__all__ = ["DIRECT_BYTES", "SealedSocket"]

DIRECT_BYTES: Final = 64 << 10
"""A buffer at least this large is sealed as records of its own, straight from where it
is; smaller ones are gathered into one record with their neighbours."""

_HEAD: Final = RECORD_HEAD.size
_FIRST: Final = 64 << 10
"""Bytes a sealed stream's buffers start with."""
_LARGEST: Final = _HEAD + MAX_RECORD + TAG_LEN


def _room(view: memoryview | None, nbytes: int) -> memoryview:
    """``view`` when it holds ``nbytes``, else a larger new buffer (twice as large at
    least, the largest record's size at most)."""
    if view is not None and view.nbytes >= nbytes:
        return view
    size = max(nbytes, 2 * view.nbytes if view is not None else nbytes)
    return memoryview(bytearray(min(size, _LARGEST)))
_raw_recv_into = socket.socket.recv_into
_raw_recv = socket.socket.recv
_raw_sendmsg = socket.socket.sendmsg
_raw_send = socket.socket.send
_raw_sendall = socket.socket.sendall


class SealedSocket(socket.socket):
    """``sock`` (taken over: it is detached) with its writes sealed by ``sealer`` and/or
    its reads opened by ``opener``; a direction without keys stays raw. Non-blocking:
    a call that can move nothing now raises BlockingIOError."""

    def __init__(self, sock: socket.socket, *, sealer: RecordKeys | None = None,
                 opener: RecordKeys | None = None) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.setblocking(False)
        self.sealer = sealer
        self.opener = opener
        if sealer is not None:
            # Buffers grow to the largest record they held (1 MiB at most): a stream of
            # large segments gathers only its headers, and stages little.
            self._outv = _room(None, _FIRST)
            self._stagev = _room(None, _FIRST)
            self._o0 = self._o1 = 0  # the ciphertext of the record under way
            self._o_plain = 0  # its plaintext bytes, not yet reported written
        if opener is not None:
            self._inv = _room(None, _FIRST)
            self._plainv = _room(None, _FIRST)
            self._p0 = self._p1 = 0  # opened bytes not read yet
            self._got = 0  # bytes of the record under way read so far
            self._need = _HEAD  # bytes it has: its head first, then all of it
            self._eof = False

    # -- writing -------------------------------------------------------------------------

    def send_records(self, iov: Sequence[memoryview]) -> int:
        """Seal ``iov`` in order as far as the socket takes it: plaintext bytes written
        (whole records only). The next call must start with the bytes this one did not
        report (a record under way covers them). BlockingIOError when none went."""
        written = 0
        if self._o1:
            if not self._flush():
                raise BlockingIOError("the sealed stream's socket is full")
            written, self._o_plain = self._o_plain, 0
        at, skip = 0, written
        while at < len(iov):
            view = iov[at]
            if skip >= view.nbytes:
                skip -= view.nbytes
                at += 1
                continue
            n = self._seal(iov, at, skip)
            self._o_plain = n
            if not self._flush():
                break
            self._o_plain = 0
            written += n
            skip += n
        if not written:
            raise BlockingIOError("the sealed stream's socket is full")
        return written

    def _seal(self, iov: Sequence[memoryview], at: int, skip: int) -> int:
        """Seal the next record from ``iov[at][skip:]`` on; its plaintext bytes."""
        first = iov[at][skip:]
        if first.nbytes >= DIRECT_BYTES:
            src = first[:MAX_RECORD]
        else:
            # Small buffers: gathered, up to a large one (sealed on its own next).
            parts, n = [first], first.nbytes
            at += 1
            while n < MAX_RECORD and at < len(iov) and iov[at].nbytes < DIRECT_BYTES:
                part = iov[at][:MAX_RECORD - n]
                parts.append(part)
                n += part.nbytes
                at += 1
            self._stagev = stage = _room(self._stagev, n)
            n = 0
            for part in parts:
                stage[n:n + part.nbytes] = part
                n += part.nbytes
            src = stage[:n]
        n = src.nbytes
        head = RECORD_HEAD.pack(n)
        self._outv = out = _room(self._outv, _HEAD + n + TAG_LEN)
        out[:_HEAD] = head
        aead, nonce = self.sealer.take()  # type: ignore[union-attr]
        aead.encrypt_into(nonce, src, head, out[_HEAD:_HEAD + n + TAG_LEN])
        self._o0, self._o1 = 0, _HEAD + n + TAG_LEN
        return n

    def _flush(self) -> bool:
        """Write the record under way; True once all of it went."""
        while self._o0 < self._o1:
            try:
                self._o0 += _raw_sendmsg(self, [self._outv[self._o0:self._o1]], (),
                                         socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return False
        self._o0 = self._o1 = 0
        return True

    def send(self, data: Any, flags: int = 0) -> int:
        if self.sealer is None:
            return int(_raw_send(self, data, flags))
        return self.send_records([memoryview(data).cast("B")])

    def sendall(self, data: Any, flags: int = 0) -> None:
        """One small message (the answer): sealed as one record, into a socket with
        room for it; BlockingIOError otherwise."""
        if self.sealer is None:
            _raw_sendall(self, data, flags)
            return
        view = memoryview(data).cast("B")
        sent = 0
        while sent < view.nbytes:
            sent += self.send_records([view[sent:]])

    # -- reading -------------------------------------------------------------------------

    def recv_records(self, iov: Sequence[memoryview]) -> int:
        """Fill ``iov`` in order with opened bytes: how many (0: the peer ended the
        stream between records). BlockingIOError when none are there now; SealError
        when a record is not the peer's next one, or the stream ends inside one."""
        got = 0
        for view in iov:
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            while view.nbytes:
                if self._p1 > self._p0:
                    n = min(view.nbytes, self._p1 - self._p0)
                    view[:n] = self._plainv[self._p0:self._p0 + n]
                    self._p0 += n
                    got += n
                    view = view[n:]
                    continue
                size = self._next_record()
                if size is None:
                    if got:
                        return got
                    raise BlockingIOError("no whole sealed record yet")
                if size == 0:
                    return got
                if view.nbytes >= size:
                    self._open_into(view[:size])
                    got += size
                    view = view[size:]
                else:
                    self._plainv = _room(self._plainv, size)  # drained: may be replaced
                    self._open_into(self._plainv[:size])
                    self._p0, self._p1 = 0, size
        return got

    def _next_record(self) -> int | None:
        """Read on until a whole record is here: its plaintext bytes; None when the
        socket has no more now; 0 at the end of the stream between records."""
        if self._eof:
            return 0
        inv = self._inv
        while self._got < self._need:
            try:
                k = _raw_recv_into(self, inv[self._got:self._need])
            except (BlockingIOError, InterruptedError):
                return None
            if k == 0:
                if self._got == 0:
                    self._eof = True
                    return 0
                raise SealError("the sealed stream ended inside a record")
            self._got += k
            if self._got == _HEAD:
                (n,) = RECORD_HEAD.unpack_from(inv)
                if not 1 <= n <= MAX_RECORD:
                    raise SealError(f"a sealed record of {n} bytes (1 to {MAX_RECORD})")
                self._need = _HEAD + n + TAG_LEN
                if inv.nbytes < self._need:
                    grown = _room(inv, self._need)
                    grown[:_HEAD] = inv[:_HEAD]
                    self._inv = inv = grown
        return self._need - _HEAD - TAG_LEN

    def _open_into(self, out: memoryview) -> None:
        """Open the record read whole into ``out`` (exactly its plaintext's size)."""
        from cryptography.exceptions import InvalidTag

        keys = self.opener
        assert keys is not None
        number = keys.next
        aead, nonce = keys.take()
        inv = self._inv
        end = self._need
        self._got, self._need = 0, _HEAD
        try:
            aead.decrypt_into(nonce, inv[_HEAD:end], inv[:_HEAD], out)
        except InvalidTag as exc:  # every other record is suspect too
            raise SealError(f"sealed record {number} failed authentication: altered, "
                            "replayed, reordered or not sealed by this stream's peer"
                            ) from exc

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if self.opener is None:
            return int(_raw_recv_into(self, buffer, nbytes, flags))
        view = memoryview(buffer).cast("B")
        return self.recv_records([view[:nbytes] if nbytes else view])

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if self.opener is None:
            return bytes(_raw_recv(self, bufsize, flags))
        buf = bytearray(bufsize)
        n = self.recv_records([memoryview(buf)])
        return bytes(buf[:n])

    def pending(self) -> int:
        """Bytes opened already and not read yet (the poller cannot see them)."""
        return self._p1 - self._p0 if self.opener is not None else 0

    def promised(self, rest: int) -> int:
        """Bytes the socket is sure to receive when the caller still waits for ``rest``
        plaintext bytes that the peer owes: the rest of the record under way, or (between
        records) at least those bytes, less what is opened already. For ``SO_RCVLOWAT``:
        waiting for more could wait for ever."""
        if self.opener is None:
            return max(rest, 1)
        if self._got:
            return self._need - self._got
        return max(rest - self.pending(), 1)

"""The requests of one connection, with no IO: which are open, which finished recently.

A :class:`RequestBook` is the session's ledger of request ids (``protocol/SPEC.md`` §7):
the client opens ids in increasing order, the server records the ids the client opened,
and both remember a bounded number of finished ids so that a reply that crossed an
``abort`` (or a ``release`` after a ``done``) is recognized as late, not unknown.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

from p2pkv.errors import LocalProtocolError
from p2pkv.protocol.codes import Code
from p2pkv.protocol.events import RequestFailed

__all__ = ["FINISHED_MEMORY", "KeyLimitExceeded", "LocalProtocolError", "Request", "RequestBook"]

FINISHED_MEMORY: Final = 4096
"""How many finished request ids a session remembers, so late replies are not violations."""


class KeyLimitExceeded(LocalProtocolError, ValueError):
    """A request with more keys than the peer accepts (``OUT_OF_BOUNDS``; ``allowed``:
    the peer's ``max_keys``). Also a ValueError: the keys are a bad argument."""

    def __init__(self, message: str, *, allowed: int, requested: int) -> None:
        super().__init__(Code.OUT_OF_BOUNDS, message)
        self.allowed = allowed
        self.requested = requested


class Request:
    """Bookkeeping of one unfinished request (either role)."""

    __slots__ = ("aborting", "deadline", "delivered", "granted", "keys", "kind", "received",
                 "shared", "until")

    def __init__(self, kind: str, keys: tuple[bytes, ...], deadline: float,
                 granted: int = 0, until: float = math.inf) -> None:
        self.kind = kind
        self.keys = keys
        #: The progress deadline: the answer (lookup), the next block or credit (fetch),
        #: the abort_ack (aborting); moved by the session as the request progresses.
        self.deadline = deadline
        #: The caller's deadline for the whole request (client; inf: none). The one
        #: clock a request has: the runtime keeps no other.
        self.until = until
        self.granted = granted  # total blocks of window granted (fetch)
        self.received = 0  # blocks sent (server) or arrived (client)
        self.delivered: set[int] = set()  # indices sent (server) or arrived (client)
        self.aborting = False
        self.shared = False  # a fetch served through the shared-memory segment (shm-v1)


class RequestBook:
    """Open requests by id, and the ids that finished lately."""

    __slots__ = ("_finished", "_next", "_open", "_order")

    def __init__(self) -> None:
        self._open: dict[int, Request] = {}
        self._finished: set[int] = set()
        self._order: deque[int] = deque()
        self._next = 1

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, req: object) -> bool:
        return req in self._open

    def __getitem__(self, req: int) -> Request:
        return self._open[req]

    def get(self, req: int) -> Request | None:
        return self._open.get(req)

    def items(self) -> list[tuple[int, Request]]:
        """A snapshot of the open requests (safe to finish some while iterating)."""
        return list(self._open.items())

    def values(self) -> list[Request]:
        return list(self._open.values())

    def finished(self, req: int) -> bool:
        """Whether ``req`` finished lately (a late reply to it is not a violation)."""
        return req in self._finished

    def open(self, kind: str, keys: tuple[bytes, ...], deadline: float, granted: int,
             limit: int, until: float = math.inf) -> int:
        """Client: the next request id, unless ``limit`` requests are open already."""
        if len(self._open) >= limit:
            raise LocalProtocolError(
                Code.TOO_MANY_IN_FLIGHT, f"{kind}: {len(self._open)} requests in flight "
                f"(limit {limit})"
            )
        req = self._next
        self._next += 1
        self._open[req] = Request(kind, keys, deadline, granted, until)
        return req

    def record(self, req: int, request: Request) -> None:
        """Server: the client opened ``req``."""
        self._open[req] = request

    def withdraw(self, req: int) -> None:
        """Client: forget ``req`` as if it had never been opened (it was never sent)."""
        self._open.pop(req, None)

    def finish(self, req: int) -> None:
        self._open.pop(req, None)
        if req not in self._finished:
            self._finished.add(req)
            self._order.append(req)
            if len(self._order) > FINISHED_MEMORY:
                self._finished.discard(self._order.popleft())

    def fail_all(self, code: int, msg: str) -> list[RequestFailed]:
        """Finish every open request; one RequestFailed each."""
        events = [RequestFailed(req, code, msg) for req in self._open]
        for req in list(self._open):
            self.finish(req)
        return events

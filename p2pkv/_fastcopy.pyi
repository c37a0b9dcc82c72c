# The compiled helper's interface (csrc/fastcopy.c); see p2pkv.checksum.
from collections.abc import Sequence
from typing import Protocol

from typing_extensions import Buffer

class HasFileno(Protocol):
    def fileno(self) -> int: ...

VARIANT: str
MAX_THREADS: int

def copy_blocks(destinations: Sequence[Sequence[Buffer]], sources: Sequence[Sequence[Buffer]],
                *, checksums: bool = ..., threads: int = ...) -> list[int] | None: ...
def hash_blocks(blocks: Sequence[Sequence[Buffer]], *, threads: int = ...) -> list[int]: ...

class Scatter:
    filled: int
    total: int
    spilled: int
    block: int
    def __init__(self, views: Sequence[Buffer], block: int = ...) -> None: ...
    @property
    def done(self) -> bool: ...
    @property
    def sums(self) -> list[int] | None: ...
    def receive(self, sock: HasFileno | int, tail: Buffer | None = ...,
                limit: int = ...) -> int | None: ...
    def put(self, data: Buffer) -> int: ...
    def close(self) -> None: ...

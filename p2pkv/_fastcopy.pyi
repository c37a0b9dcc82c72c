# The compiled helper's interface (csrc/fastcopy.c); see p2pkv.checksum.
from collections.abc import Sequence

from typing_extensions import Buffer

VARIANT: str
MAX_THREADS: int

def copy_blocks(destinations: Sequence[Sequence[Buffer]], sources: Sequence[Sequence[Buffer]],
                *, checksums: bool = ..., threads: int = ...) -> list[int] | None: ...
def hash_blocks(blocks: Sequence[Sequence[Buffer]], *, threads: int = ...) -> list[int]: ...

"""Same-host shared memory: pool segments, their header, and the host identity (pure).

``segment`` creates, maps and cleans up the named POSIX shared-memory segments a block
pool can live in (``protocol/SPEC.md`` §16); ``host`` reads the identity the same-host
proof compares. Nothing here imports zmq or torch.
"""

from __future__ import annotations

from p2pkv.shm.host import HostIdentity, ShmUnavailable, host_identity
from p2pkv.shm.segment import (
    NAME_PATTERN,
    NAME_PREFIX,
    SHM_DIR,
    MappedSegment,
    SharedSegment,
    remove_stale,
)

__all__ = [
    "NAME_PATTERN",
    "NAME_PREFIX",
    "SHM_DIR",
    "HostIdentity",
    "MappedSegment",
    "SharedSegment",
    "ShmUnavailable",
    "host_identity",
    "remove_stale",
]

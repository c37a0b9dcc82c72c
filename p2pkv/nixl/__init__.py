"""One-sided reads of a peer's block memory through NIXL (the ``nixl-v1`` data path).

A holder registers its block pool with an :class:`Exporter` (a NIXL agent owned and
progressed by a thread of its own) and sends the agent's metadata blob to its peers; a
reader loads the blob into its :class:`Importer` (an agent owned by the reader's IO
thread) and reads blocks straight out of the holder's memory into a staging area, one
READ per batch. NIXL moves the data over UCX: RDMA where the host has it
(:func:`rdma_devices`), else TCP, or ``process_vm_readv`` between two processes of one
host.

NIXL is optional. Nothing here imports it before it is needed, and
:func:`unavailable_reason` says whether it can be used here, without raising.
``agent`` holds what both sides share (loading NIXL, the errors, what the host
offers), ``exporter`` the holder's side, ``importer`` the reader's.
"""

from __future__ import annotations

from p2pkv.nixl.agent import (
    NixlReadFailed,
    NixlUnavailable,
    rdma_devices,
    ucx_version,
    unavailable_reason,
)
from p2pkv.nixl.exporter import NONCE_BYTES, Exporter
from p2pkv.nixl.importer import Importer

__all__ = [
    "NONCE_BYTES",
    "Exporter",
    "Importer",
    "NixlReadFailed",
    "NixlUnavailable",
    "rdma_devices",
    "ucx_version",
    "unavailable_reason",
]

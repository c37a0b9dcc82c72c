"""Who and where this process is: the facts the same-host proof compares (pure, Linux).

A shared-memory segment records its owner's host identity (``protocol/SPEC.md`` §16): the
kernel's boot id (one per boot of one machine), the owner's network namespace and PID
namespace. Two processes are "on the same host" for p2pkv when their boot ids and network
namespaces are equal and one can map the other's segment: a node in another network
namespace is another host to the network, so it is one here too (containers and the
network-namespace tests rely on that).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from functools import lru_cache

from p2pkv.errors import P2PKVError

__all__ = ["HostIdentity", "ShmUnavailable", "host_identity", "process_alive",
           "process_start_time"]


class ShmUnavailable(P2PKVError):
    """Shared memory cannot be used here or with this peer; the message says why."""


@dataclass(frozen=True, slots=True)
class HostIdentity:
    """The boot id (16 bytes) and the network and PID namespaces (inode numbers)."""

    boot_id: bytes
    netns: int
    pidns: int


@lru_cache(maxsize=1)
def _cached_identity() -> HostIdentity:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = uuid.UUID(f.read().strip()).bytes
        netns = os.stat("/proc/self/ns/net").st_ino
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError) as exc:
        raise ShmUnavailable(f"cannot read this host's identity from /proc: {exc}") from None
    return HostIdentity(boot, netns, pidns)


def host_identity() -> HostIdentity:
    """This process's :class:`HostIdentity`; :class:`ShmUnavailable` without ``/proc``.

    Namespaces do not change under a running node, so the answer is read once.
    """
    return _cached_identity()


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None when no such
    process exists (field 22 of ``/proc/PID/stat``; with the pid it names one process
    for the whole boot, even after the pid is reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain anything: split after it.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process that had ``pid`` and ``start_time`` still runs."""
    return process_start_time(pid) == start_time

"""Network namespaces of a run's own: the primitives the benchmarks' emulated hosts and
the chaos run's partition are made of (root only; Linux).

- :func:`ip` runs iproute2 with a deadline and says what failed;
- :func:`in_netns` makes something (a socket) on a short-lived thread inside a
  namespace: a socket belongs to the namespace of the thread that made it;
- :func:`entered` moves the calling thread into a namespace for a ``with`` block and back
  out: what it connects to, listens on and starts (threads, subprocesses) in the block
  lives there;
- :func:`remove_stale` deletes the namespaces of earlier runs whose process is gone
  (killed before it cleaned up), by the pid each run puts in its namespaces' names.

Nothing here touches the machine's own namespace: every address and link lives in
namespaces the caller made and deletes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["Unavailable", "check_available", "entered", "in_netns", "ip", "remove_stale",
           "run"]

_CLONE_NEWNET = 0x40000000
#: Seconds an ``ip``/``tc`` command may take (a busy machine takes a few hundred ms).
COMMAND_TIMEOUT = 20.0
T = TypeVar("T")


class Unavailable(Exception):
    """Namespaces cannot be used here; the message says why."""


def check_available() -> None:
    """Raise :class:`Unavailable` with the reason when this process cannot make
    namespaces (not root, no iproute2)."""
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise Unavailable("iproute2's 'ip' is not installed")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``; raises RuntimeError with its stderr when it fails and ``check``."""
    return run(["ip", *args], check=check)


def run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """A short administrative command (``ip``, ``tc``) with a deadline."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): "
                           f"{done.stderr.strip()}")
    return done


def _setns(fd: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns into {what}: {os.strerror(errno)}")


def _enter(name: str) -> None:
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(fd, name)
    finally:
        os.close(fd)


def in_netns(name: str, make: Callable[[], T], timeout: float = 30.0) -> T:
    """``make()`` run on a thread inside network namespace ``name`` (its sockets are
    that namespace's); its exception is raised here. Raises OSError when it does not
    return within ``timeout`` seconds."""
    out: list[T] = []
    err: list[BaseException] = []

    def work() -> None:
        try:
            _enter(name)
            out.append(make())
        except BaseException as exc:
            err.append(exc)

    thread = threading.Thread(target=work, name="p2pkv-netns", daemon=True)
    thread.start()
    thread.join(timeout)
    if err:
        raise err[0]
    if not out:
        raise OSError(f"nothing made in namespace {name} within {timeout:.0f} s")
    return out[0]


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """The calling thread inside network namespace ``name`` for the block, and back in
    its own namespace after it, whatever the block raised. Threads and processes the
    block starts stay in ``name`` (a namespace is inherited at creation)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _enter(name)
        try:
            yield
        finally:
            _setns(own, "the thread's own namespace")
    finally:
        os.close(own)


def remove_stale(prefix: str) -> None:
    """Delete namespaces named ``PREFIX<pid>-...`` whose process is gone."""
    listed = ip("netns", "list", check=False).stdout.split()
    for name in (n for n in listed if n.startswith(prefix)):
        pid = name[len(prefix):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            ip("netns", "del", name, check=False)

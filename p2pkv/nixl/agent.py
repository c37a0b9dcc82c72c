"""Loading NIXL, making agents, and what this host offers it (the common part of
:mod:`p2pkv.nixl`).

NIXL is optional: nothing of p2pkv imports it at module level, and every entry point
here turns "not installed", "cannot make an agent" and "no UCX backend" into
:class:`NixlUnavailable` with a sentence that says which. The module loaded is
``nixl_cu12._api`` (or ``nixl_cu13._api``) itself, not the ``nixl`` shim: the shim
imports torch to learn the CUDA version, which costs a second or more and that this
package does not need (registering host memory by address needs no tensor).

``NIXL_LOG_LEVEL`` defaults to ``WARN`` before the first import, unless the environment
sets it: at NIXL's default level its Python logger writes INFO lines to stdout.

Agents made here have the UCX backend only, and neither NIXL thread: the listener (no
metadata server; blobs travel over p2pkv's own connections) nor the progress thread
(the wrapper fixes its delay at 0, so it spins a core). NIXL's agents are not safe to
share between threads (two threads on one agent crash the process), so each agent is
owned by one thread: :class:`~p2pkv.nixl.exporter.Exporter` makes its own,
:class:`~p2pkv.nixl.importer.Importer` belongs to its caller's thread.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Final

from p2pkv.errors import P2PKVError

__all__ = [
    "API_MODULES",
    "NixlReadFailed",
    "NixlUnavailable",
    "agent_name_of",
    "load_api",
    "new_agent",
    "rdma_devices",
    "ucx_version",
    "unavailable_reason",
]

API_MODULES: Final = ("nixl_cu12", "nixl_cu13")
"""The packages that hold NIXL's Python API (``<package>._api``), tried in this order."""
_INFINIBAND: Final = Path("/sys/class/infiniband")
_METADATA_MAGIC: Final = b"nixlSerDes|Agent"
#: The longest agent name :func:`agent_name_of` accepts (names are ``p2pkv-<node id>``).
_MAX_NAME: Final = 256


class NixlUnavailable(P2PKVError):
    """NIXL cannot be used here: it is not installed, or no agent could be made (the
    message says why)."""


class NixlReadFailed(P2PKVError):
    """One NIXL read did not complete.

    ``peer_fault`` is True where the holder's answer was at fault: pieces outside what
    it registered (NIXL refuses their descriptors before anything is sent), pieces that
    are not byte ranges at all, or a metadata blob NIXL refuses. It is False for what
    says nothing about the holder's honesty: a deadline reached, a disconnect, a local
    error, reads suspended (see :class:`~p2pkv.nixl.importer.Importer`).
    """

    def __init__(self, message: str, *, peer_fault: bool) -> None:
        super().__init__(message)
        self.peer_fault = peer_fault


_lock = threading.Lock()
_api: Any = None
_import_error: str | None = None
_reason: list[str | None] = []  # the cached answer of unavailable_reason(), once known


def load_api() -> Any:
    """NIXL's Python API module (``nixl_cu12._api``); NixlUnavailable when none imports.

    Imported once; later calls return the same module or raise the same reason.
    """
    global _api, _import_error
    with _lock:
        if _api is None and _import_error is None:
            os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
            errors = []
            for package in API_MODULES:
                try:
                    _api = importlib.import_module(f"{package}._api")
                    break
                except Exception as exc:  # an ImportError, or a broken native library
                    errors.append(f"{package}: {type(exc).__name__}: {exc}")
            else:
                _import_error = "NIXL is not importable (" + "; ".join(errors) + ")"
        if _import_error is not None:
            raise NixlUnavailable(_import_error)
        return _api


def new_agent(name: str) -> Any:
    """A NIXL agent named ``name`` with the UCX backend only and no NIXL thread.

    Made on the calling thread, which then owns it. UCX reads its environment
    (``UCX_TLS``, ``UCX_NET_DEVICES``, ...) here, once per agent. NixlUnavailable when
    NIXL is missing, the agent cannot be made, or the UCX backend did not start.
    """
    api = load_api()
    config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                   backends=["UCX"])
    try:
        agent = api.nixl_agent(name, config)
    except Exception as exc:
        raise NixlUnavailable(f"cannot create NIXL agent {name!r}: {type(exc).__name__}: "
                              f"{exc}") from None
    if "UCX" not in agent.backends:
        # nixl_agent skips a backend whose plugin is missing with a warning only.
        raise NixlUnavailable("NIXL has no UCX backend here (its plugin is missing)")
    return agent


def unavailable_reason() -> str | None:
    """None when NIXL imports and can make an agent here, else why not.

    The first call makes (and drops) one agent, about half a second in a fresh process
    (UCX initialisation); the answer is cached.
    """
    if _reason:
        return _reason[0]
    try:
        agent = new_agent(f"p2pkv-probe-{os.getpid()}-{secrets.token_hex(4)}")
    except NixlUnavailable as exc:
        answer: str | None = str(exc)
    else:
        del agent
        answer = None
    with _lock:
        if not _reason:
            _reason.append(answer)
        return _reason[0]


def _libucp() -> Path | None:
    """The libucp bundled with the NIXL wheel (``<package>.libs/libucp-*.so*``)."""
    for package in API_MODULES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        libs = Path(next(iter(spec.submodule_search_locations))).parent / f"{package}.libs"
        found = sorted(libs.glob("libucp-*.so*"))
        if found:
            return found[0]
    return None


_ucx_version: list[str | None] = []


def ucx_version() -> str | None:
    """The version of the UCX bundled with NIXL (``"1.23.0"``), or None if unknown.

    Read from the library itself (``ucp_get_version_string``), without importing NIXL.
    """
    if not _ucx_version:
        version: str | None = None
        path = _libucp()
        if path is not None:
            try:
                ucp = ctypes.CDLL(str(path))
                ucp.ucp_get_version_string.restype = ctypes.c_char_p
                raw = ucp.ucp_get_version_string()
                version = raw.decode("ascii", "replace") if raw else None
            except (OSError, AttributeError):
                version = None
        _ucx_version.append(version)
    return _ucx_version[0]


def rdma_devices() -> tuple[str, ...]:
    """The RDMA devices of this host (names under ``/sys/class/infiniband``), sorted;
    empty where there are none. UCX moves data over them when they exist; without them
    NIXL still works, over TCP or shared memory."""
    try:
        return tuple(sorted(os.listdir(_INFINIBAND)))
    except OSError:
        return ()


def agent_name_of(metadata: bytes) -> str | None:
    """The agent name a NIXL metadata blob announces, or None when the blob does not
    start like one (``nixlSerDes|Agent``, a little-endian 64-bit length, the name).

    Read before the blob is given to NIXL: a holder restarted under the same name sends
    a new blob that NIXL refuses until the old one is removed, and removing it needs the
    name.
    """
    head = len(_METADATA_MAGIC)
    if not metadata.startswith(_METADATA_MAGIC) or len(metadata) < head + 8:
        return None
    size = int.from_bytes(metadata[head:head + 8], "little")
    if not 1 <= size <= _MAX_NAME or len(metadata) < head + 8 + size:
        return None
    try:
        return metadata[head + 8:head + 8 + size].decode("utf-8")
    except UnicodeDecodeError:
        return None

"""Which LoRA adapter each request runs under, known by its content (see
:mod:`p2pkv.identity.adapter`), and the keys its chunks are shared under.

vLLM's block hashes carry a request's adapter name and path, never its content, so two
engines holding different files under the same name and path (any rolling update of an
adapter) compute equal keys for KV that is not interchangeable. The tier therefore
salts the offload keys of every request that runs under an adapter with the adapter's
content digest before they leave the engine (lookups, stores, loads, the directory):
engines whose adapter files differ in any byte never share a key, so a mismatch is a
miss. Requests without an adapter keep vLLM's keys and share as before, also between an
engine with LoRA enabled and one without it.

How the tier learns a request's adapter. vLLM hands a tier only a ``ReqContext`` (the
request id, its transfer parameters and hints). p2pkv's connector
(:class:`~p2pkv.integrations.vllm.P2PKVConnector`) receives the scheduler's ``Request``
and hands its ``lora_request`` to :meth:`RequestAdapters.begin`. An engine without LoRA
enabled (``VllmConfig.lora_config`` unset) serves no adapter, and nothing is asked.
Where LoRA is enabled and a request was not handed over (the tier runs under vLLM's
plain ``OffloadingConnector``), or its adapter's files cannot be read, the request's
chunks are neither stored for peers nor looked up: a miss, counted by reason and logged
once, never a guess.

The digest is computed on a thread of its own the first time an adapter's files are
met (and again when a file changes: the digest cache is keyed by stat). Until it is
known, the request's lookups answer RETRY and its stores wait, bounded.

Threads: :meth:`begin` and :meth:`finished` run on the scheduler thread, :meth:`keys`
on the lookup and store threads; every method is thread-safe.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from p2pkv.identity.adapter import (
    AdapterError,
    AdapterIdentity,
    adapter_identity,
    adapter_key,
    adapter_name_key,
    adapter_signature,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey, ReqContext

__all__ = ["ADAPTER_MISMATCH", "ADAPTER_UNKNOWN", "ADAPTER_UNREADABLE", "AdapterKeys",
           "RequestAdapter", "RequestAdapters", "first_chunk", "first_chunk_tokens"]

log = logging.getLogger("vllm.p2pkv")

#: ``reason`` of chunks not shared because LoRA is enabled and the tier was not told the
#: request's adapter (it runs under vLLM's plain ``OffloadingConnector``).
ADAPTER_UNKNOWN: Final = "adapter_unknown"
#: ``reason`` of chunks not shared because the adapter's files cannot be read or hashed.
ADAPTER_UNREADABLE: Final = "adapter_unreadable"
#: ``reason`` of chunks a peer computed under an adapter of the same name and path with
#: other content (a rolling update): looked up, missed, recomputed here.
ADAPTER_MISMATCH: Final = "adapter_mismatch"

@dataclass(frozen=True)
class _Adapter:
    name: str
    lora_id: int
    #: As the request names it (and as vLLM hashes it).
    path: str
    digest: Future[AdapterIdentity]


#: A request's adapter as :meth:`RequestAdapters.begin` was told it: None (no adapter), an
#: adapter, or the reason (:data:`ADAPTER_UNKNOWN`) it is not known.
RequestAdapter = _Adapter | str | None


@dataclass(frozen=True)
class AdapterKeys:
    """The keys a batch of one request is shared under, or why it is not shared."""

    #: Salted keys (an adapter), vLLM's keys (no adapter), or None: not shared.
    keys: list[bytes] | None
    #: Why not shared (:data:`ADAPTER_UNKNOWN`, :data:`ADAPTER_UNREADABLE`), else None.
    reason: str | None = None
    #: The adapter, for logs (``name@digest``), when the request runs under one.
    adapter: str | None = None
    #: The name-and-path key of each of ``keys`` (adapters only): held by a peer that
    #: computed the chunk under another content of this adapter.
    name_keys: list[bytes] | None = None


class RequestAdapters:
    """Each live request's adapter, and the keys its chunks are shared under."""

    def __init__(self, *, lora_enabled: bool, cache: Path | None = None,
                 count: Callable[[str, int], None] | None = None) -> None:
        self.lora_enabled = lora_enabled
        self._cache = cache
        self._count = count
        self._lock = threading.Lock()
        self._requests: dict[str, RequestAdapter] = {}
        # Resolved path -> the digest of its files, and their stat when it was asked.
        self._digests: dict[str, tuple[Any, Future[AdapterIdentity]]] = {}
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, "p2pkv-adapter")
        self._logged: set[tuple[str, str]] = set()
        self._unshared: dict[str, int] = {}
        self._seen: dict[str, str] = {}

    # ------------------------------------------------------------------ scheduler thread

    def begin(self, req_id: str, lora_request: Any) -> None:
        """A new request and vLLM's ``LoRARequest`` it runs under (None: the base model):
        start hashing the adapter's files if they are not known yet (a stat, and the
        hash queued on the tier's hashing thread)."""
        if not self.lora_enabled:
            return
        state: RequestAdapter
        if lora_request is None:
            state = None
        else:
            path = str(lora_request.lora_path)
            state = _Adapter(name=str(lora_request.lora_name),
                             lora_id=int(lora_request.lora_int_id), path=path,
                             digest=self._digest_of(path))
        with self._lock:
            self._requests[req_id] = state

    def finished(self, req_id: str) -> None:
        with self._lock:
            self._requests.pop(req_id, None)

    def pending(self, req_id: str) -> bool:
        """True while the digest of the request's adapter is being computed."""
        with self._lock:
            state = self._requests.get(req_id)
        return isinstance(state, _Adapter) and not state.digest.done()

    # ------------------------------------------------------------------ lookup/store threads

    def state(self, req_id: str) -> RequestAdapter:
        """What request ``req_id`` runs under, as :meth:`begin` was told it (a request that
        finished since keeps it: take it before handing work to another thread)."""
        if not self.lora_enabled:
            return None
        with self._lock:
            return self._requests.get(req_id, ADAPTER_UNKNOWN)

    def keys(self, req_id: str, keys: Sequence[bytes], *, wait: float = 0.0) -> AdapterKeys:
        """:meth:`shared` for a live request."""
        return self.shared(self.state(req_id), keys, wait=wait, req_id=req_id)

    def shared(self, state: RequestAdapter, keys: Sequence[bytes], *, wait: float = 0.0,
               req_id: str = "?") -> AdapterKeys:
        """The keys ``keys`` (vLLM's) of a request that runs under ``state`` are shared
        under, waiting up to ``wait`` seconds for the adapter's digest (then: not
        shared, unreadable)."""
        if state is None:
            return AdapterKeys(keys=list(keys))
        if isinstance(state, str):
            self._log_once(state, "", f"LoRA is enabled and the tier was not told which "
                           f"adapter request {req_id} runs under (vLLM's plain "
                           "OffloadingConnector does not say; P2PKVConnector does): its "
                           "chunks are not shared (logged for the first such request only)")
            return AdapterKeys(keys=None, reason=state)
        label = f"{state.name} ({state.path})"
        try:
            identity = state.digest.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            self._not_shared(ADAPTER_UNREADABLE, label, "its digest is still being computed")
            return AdapterKeys(keys=None, reason=ADAPTER_UNREADABLE, adapter=label)
        except AdapterError as exc:
            self._not_shared(ADAPTER_UNREADABLE, label, str(exc))
            return AdapterKeys(keys=None, reason=ADAPTER_UNREADABLE, adapter=label)
        with self._lock:
            self._seen[label] = identity.digest
        return AdapterKeys(
            keys=[adapter_key(identity.digest, bytes(k)) for k in keys],
            adapter=f"{state.name}@{identity.digest}",
            name_keys=[adapter_name_key(state.name, state.path, bytes(k)) for k in keys])

    def count(self, reason: str, chunks: int) -> None:
        """Count ``chunks`` not shared for ``reason`` (stats and the tier's metric)."""
        if chunks <= 0:
            return
        with self._lock:
            self._unshared[reason] = self._unshared.get(reason, 0) + chunks
        if self._count is not None:
            self._count(reason, chunks)

    def mismatch(self, adapter: str, chunks: int) -> None:
        """A peer holds this prefix under an adapter of the same name and path with
        other content: counted, and logged once per adapter."""
        self.count(ADAPTER_MISMATCH, chunks)
        self._log_once(ADAPTER_MISMATCH, adapter,
                       "a peer holds this prompt's KV under an adapter with the same name "
                       "and path but other content (a rolling update?): not loaded, "
                       "recomputed here")

    def describe(self) -> dict[str, Any]:
        """For the tier's ``stats()``."""
        with self._lock:
            return {"lora_enabled": self.lora_enabled, "unshared_blocks": dict(self._unshared),
                    "adapters": dict(self._seen)}

    def shutdown(self) -> None:
        self._hasher.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _not_shared(self, reason: str, what: str, why: str) -> None:
        self._log_once(reason, what, f"its chunks are not shared ({why})")

    def _log_once(self, reason: str, what: str, message: str) -> None:
        """Warn once per reason and adapter (``what``; empty: once per reason)."""
        with self._lock:
            if (reason, what) in self._logged:
                return
            self._logged.add((reason, what))
        where = f"adapter {what}: " if what else ""
        log.warning("p2pkv tier: %s: %s%s", reason, where, message)

    def _digest_of(self, path: str) -> Future[AdapterIdentity]:
        """The digest of the adapter at ``path``, resolved as vLLM resolves it: reused
        while its files keep their stat, computed again (off this thread) otherwise."""
        resolved = _resolve(path)
        signature = adapter_signature(resolved)
        with self._lock:
            known = self._digests.get(resolved)
            if known is not None and signature is not None and known[0] == signature:
                return known[1]
            fut = self._hasher.submit(self._hash, resolved)
            self._digests[resolved] = (signature, fut)
        return fut

    def _hash(self, resolved: str) -> AdapterIdentity:
        try:
            identity = adapter_identity(resolved, cache=self._cache)
        except AdapterError:
            raise
        except Exception as exc:  # never let a surprise leave a request hanging
            raise AdapterError(f"cannot hash adapter {resolved!r}: {exc}") from None
        log.info("p2pkv tier: %s at %s", identity.describe(), resolved)
        return identity


def first_chunk_tokens(spec: OffloadingSpec) -> int:
    """Tokens up to the end of a request's first offload chunk (the longest of its
    groups' chunks): a key whose position is at most this is a first chunk."""
    groups = spec.tokens_per_block
    return max(groups) * spec.blocks_per_chunk if groups else 1


def first_chunk(key: OffloadKey, req_context: ReqContext, tokens: int) -> bool:
    """True for the offload key of a request's first chunk (of its group): its end
    position, as the scheduler recorded it, is at most ``tokens``. A request's first
    chunk is kept under its adapter's name-and-path key too (see
    :attr:`AdapterKeys.name_keys`)."""
    position = req_context.get_offload_key_position(key)
    return position is not None and position <= tokens


def _resolve(path: str) -> str:
    """The local directory vLLM loads for ``lora_path`` (``get_adapter_absolute_path``:
    absolute as given, ``~`` expanded, a relative path that exists made absolute, else
    a hub id through the local Hugging Face cache)."""
    if os.path.isabs(path):
        return path
    if path.startswith("~"):
        return os.path.expanduser(path)
    if os.path.exists(path):
        return os.path.abspath(path)
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, local_files_only=True))
    except Exception as exc:
        log.info("p2pkv tier: adapter %r is not a local directory nor in the local Hugging "
                 "Face cache (%s: %s); its digest will fail with the reason", path,
                 type(exc).__name__, exc)
        return path  # hashing fails with a clear error: not a directory here

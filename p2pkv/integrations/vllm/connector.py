"""p2pkv's vLLM connector: vLLM's offloading connector, handing the p2pkv tier what the
plain one does not.

vLLM builds a secondary tier from inside its offloading connector and then hands it only
what its API carries: the offloading spec, and per request a ``ReqContext`` (the id,
transfer parameters, hints). The tier needs more:

- the engine's ``VllmConfig``, for its identity (weights, revision, overrides, whether
  LoRA is enabled): :class:`P2PKVConnector` receives it in its constructor and makes it
  known to the tiers built inside that constructor (:func:`building`);
- each request's block hashes, known at arrival: the tier asks its peers about the
  prompt's chunks then, so that the scheduler's first lookup can answer HIT or MISS
  instead of deferring the request a step (:mod:`~p2pkv.integrations.vllm.lookups`);
- each request's LoRA adapter: vLLM's block hashes name an adapter, not its files, so the
  tier salts the keys of a request under an adapter with the files' digest
  (:mod:`~p2pkv.integrations.vllm.adapters`). :meth:`P2PKVConnector.on_new_request`
  receives the scheduler's ``Request`` and hands the tier its ``lora_request`` before
  the offloading connector starts the request;
- whether a scheduler step scheduled anything: vLLM's loop does not pause while its
  only requests wait on a tier, and on a machine of few cores the spinning takes CPU
  from the peer computing what they wait for. :meth:`P2PKVConnector.build_connector_meta`
  tells the tiers of a step that scheduled no token and left no transfer under way, and
  a tier whose lookups are waiting sleeps briefly instead.

Load it by module path, with the p2pkv tier in ``secondary_tiers`` as before::

    {"kv_connector": "P2PKVConnector",
     "kv_connector_module_path": "p2pkv.integrations.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {...}}

Everything else is vLLM's ``OffloadingConnector``: the same spec, primary region,
lookups, loads and stores. Under the plain ``OffloadingConnector`` the tier refuses to
start (it cannot see the engine's configuration) unless the caller set vLLM's current
configuration (``set_current_vllm_config``), and it never learns an adapter: with LoRA
enabled it says so at start and counts those requests' chunks as ``adapter_unknown``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorContext", "P2PKVConnector", "building"]


class _Tier(Protocol):
    def begin_request(self, req_id: str, lora_request: Any,
                      block_hashes: Sequence[bytes] = ()) -> None: ...

    def scheduled_nothing(self) -> None: ...


@dataclass
class ConnectorContext:
    """What a :class:`P2PKVConnector` hands the tiers built in its constructor."""

    vllm_config: Any
    #: The p2pkv tiers that were built, each registered by its own constructor.
    tiers: list[_Tier] = field(default_factory=list)


_BUILDING: contextvars.ContextVar[ConnectorContext | None] = contextvars.ContextVar(
    "p2pkv_connector_building", default=None)


def building() -> ConnectorContext | None:
    """The context of the :class:`P2PKVConnector` whose constructor is running on this
    thread (the one building the calling tier), or None: the tier was built by another
    connector, or directly."""
    return _BUILDING.get()


@contextmanager
def _building(context: ConnectorContext) -> Iterator[None]:
    token = _BUILDING.set(context)
    try:
        yield
    finally:
        _BUILDING.reset(token)


class P2PKVConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` that hands the p2pkv tier the engine's
    configuration and each request's LoRA adapter (see the module doc)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        context = ConnectorContext(vllm_config)
        with _building(context):
            super().__init__(vllm_config, role, kv_cache_config)
        # Scheduler role: the tiers of this engine; worker role: none (tiers live in the
        # scheduler's process only).
        self._p2pkv_tiers: tuple[_Tier, ...] = tuple(context.tiers)

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        # After the tiers' own end of step (their lookups gathered in it are asked).
        if self._p2pkv_tiers and scheduler_output.total_num_scheduled_tokens == 0 and \
                not self.has_pending_push_work():
            for tier in self._p2pkv_tiers:
                tier.scheduled_nothing()
        return meta

    def on_new_request(self, request: Request) -> None:
        # Before the offloading connector starts the request (vLLM 0.33 calls the
        # tier's own hook under its manager lock): the adapter's stat and, the first
        # time its files are met, the queueing of their digest happen here, and the
        # lookup of the prompt's chunks starts, so that the scheduler's first lookup
        # finds its answer.
        for tier in self._p2pkv_tiers:
            tier.begin_request(request.request_id, getattr(request, "lora_request", None),
                               request.block_hashes)
        super().on_new_request(request)

"""p2pkv inside vLLM: a secondary tier of vLLM's offloading connector, loaded through
p2pkv's connector.

Turn it on with ``--kv-transfer-config`` (see the README's "vLLM" section)::

    {"kv_connector": "P2PKVConnector", "kv_connector_module_path": "p2pkv.integrations.vllm",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {
        "spec_name": "P2PKVTieringSpec", "spec_module_path": "p2pkv.integrations.vllm",
        "cpu_bytes_to_use": 1073741824,
        "secondary_tiers": [{"type": "P2PKVTier", "module_path": "p2pkv.integrations.vllm",
                             "listen": "tcp://0.0.0.0:5601",
                             "peers": ["tcp://engine-b:5601"]}]}}

:class:`P2PKVConnector` is vLLM's offloading connector that hands the tier the engine's
configuration and each request's LoRA adapter; :class:`P2PKVTier` is the tier (scheduler
process); :class:`P2PKVTieringSpec` is vLLM's tiering spec that also runs on CPU-only
builds (on GPUs it is the stock spec).

These names load on first use (PEP 562; vLLM looks each one up with ``getattr``), so that
the modules of the package that need no vLLM (:mod:`~p2pkv.integrations.vllm.loadpolicy`,
the load-or-recompute decision) import without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pkv.integrations.vllm.connector import P2PKVConnector
    from p2pkv.integrations.vllm.options import kv_transfer_config
    from p2pkv.integrations.vllm.spec import CPUCopyWorker, P2PKVTieringSpec
    from p2pkv.integrations.vllm.tier import P2PKVTier

__all__ = ["CPUCopyWorker", "P2PKVConnector", "P2PKVTier", "P2PKVTieringSpec",
           "kv_transfer_config"]

# Public name -> the module that defines it.
_LAZY: dict[str, str] = {
    "CPUCopyWorker": "p2pkv.integrations.vllm.spec",
    "P2PKVConnector": "p2pkv.integrations.vllm.connector",
    "P2PKVTier": "p2pkv.integrations.vllm.tier",
    "P2PKVTieringSpec": "p2pkv.integrations.vllm.spec",
    "kv_transfer_config": "p2pkv.integrations.vllm.options",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

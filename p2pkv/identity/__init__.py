"""The identity of a node's KV cache: the run config, its digest and the field-level diff
(:mod:`p2pkv.identity.runconfig`), and the identity extension
(:mod:`p2pkv.identity.extension`).

The hashed dict reproduces vLLM's ``FileMapper`` run config exactly, so a p2pkv namespace
equals the one vLLM computes for the same configuration (see ``protocol/SPEC.md``,
section "Identity"). The **identity extension** (:class:`IdentityExtension`) declares
what the run config cannot see but that still decides whether two KV caches are
interchangeable: the block byte order in the engine's memory, the weights revision, the
model overrides that change the K/V values, and the engine's block-key hash. It travels
in the handshake next to the run config and is never hashed into the fingerprint, so
namespaces stay equal to vLLM's. Pure: no IO, no torch, no zmq. The one module that
reads files, :mod:`p2pkv.identity.checkpoint` (the ``model_weights`` and ``model_config``
digests of a checkpoint on disk), is not imported here.
"""

from __future__ import annotations

from p2pkv.identity.extension import (
    EXTENSION_FIELDS,
    EXTENSION_REFUSAL_FIELDS,
    IDENTITY_POLICIES,
    KV_MEMORY_LAYOUT_ALIASES,
    KV_MEMORY_LAYOUTS,
    IdentityExtension,
    canonical_model_overrides,
    extension_diff,
    key_hash_identity,
    kv_memory_layout_meaning,
    model_overrides_digest,
)
from p2pkv.identity.runconfig import (
    ABSENT,
    FINGERPRINT_HEX_LEN,
    NAMESPACE_HEX_LEN,
    FieldDiff,
    RunConfig,
    canonical_json,
    diff,
    digest,
    fingerprint_of,
)

__all__ = [
    "ABSENT",
    "EXTENSION_FIELDS",
    "EXTENSION_REFUSAL_FIELDS",
    "FINGERPRINT_HEX_LEN",
    "IDENTITY_POLICIES",
    "KV_MEMORY_LAYOUTS",
    "KV_MEMORY_LAYOUT_ALIASES",
    "NAMESPACE_HEX_LEN",
    "FieldDiff",
    "IdentityExtension",
    "RunConfig",
    "canonical_json",
    "canonical_model_overrides",
    "diff",
    "digest",
    "extension_diff",
    "fingerprint_of",
    "key_hash_identity",
    "kv_memory_layout_meaning",
    "model_overrides_digest",
]

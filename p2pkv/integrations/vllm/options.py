"""The options of :class:`~p2pkv.integrations.vllm.P2PKVTier`: which tier-config keys it
takes, their defaults, and their validation with the launcher's own parsers.

Imports nothing from vLLM, so a bad tier option is explained the same way everywhere.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from p2pkv.errors import ConfigError
from p2pkv.integrations.vllm.loadpolicy import LoadPolicyConfig
from p2pkv.protocol.options import OPTIONS, TIER, option
from p2pkv.transport import validate_address

#: The two keys of ``--kv-transfer-config`` that load
#: :class:`~p2pkv.integrations.vllm.P2PKVConnector` (``connector.py``).
CONNECTOR_CONFIG: Final = {"kv_connector": "P2PKVConnector",
                           "kv_connector_module_path": "p2pkv.integrations.vllm"}
#: The same, as it is written inside ``--kv-transfer-config`` (for messages).
CONNECTOR_KEYS: Final = json.dumps(CONNECTOR_CONFIG)[1:-1]

__all__ = [
    "CONNECTOR_CONFIG",
    "CONNECTOR_KEYS",
    "DEFAULT_IDENTITY_TIMEOUT",
    "TIER_DEFAULTS",
    "TIER_OPTIONS",
    "TierWaits",
    "kv_transfer_config",
    "load_policy_config",
    "tier_error",
    "tier_node_config",
    "tier_settings",
]

#: Tier-config keys taken by this tier, from the one table (p2pkv.protocol.options; the
#: node options keep their ``serve`` names, the launcher's repeated ``peer`` is
#: ``peers``; see docs/configuration.md). Identity options are absent on purpose: the
#: identity is vLLM's own, read from the offloading spec.
TIER_OPTIONS: tuple[str, ...] = tuple("peers" if o.name == "peer" else o.name
                                      for o in OPTIONS if TIER in o.where)
#: Defaults that differ from ``serve``'s (a scheduler waits on lookups, so silence
#: becomes a miss sooner; a load that takes longer than recomputing is not worth waiting).
TIER_DEFAULTS: Mapping[str, Any] = {o.name: o.tier_default for o in OPTIONS
                                    if TIER in o.where and o.tier_default is not None}
#: The tier's own options (no ``p2pkv-node`` flag), checked here.
_TIER_ONLY = tuple(o.name for o in OPTIONS if o.where == {TIER})
DEFAULT_IDENTITY_TIMEOUT: Final[float] = option("identity_timeout").default


def _default(name: str) -> Any:
    return option(name).default


@dataclass(frozen=True)
class TierWaits:
    """The tier's own waits (seconds), beside the node's deadlines in its settings."""

    reconnect: float = _default("reconnect_interval")
    refused_retry: float = _default("refused_retry_interval")
    drain_grace: float = _default("drain_grace")
    identity: float = _default("identity_timeout")
    lookup_wait: float = _default("lookup_wait")
    pending_wait: float = _default("pending_wait")


def tier_settings(params: Mapping[str, Any]) -> tuple[Any, tuple[str, ...], TierWaits]:
    """Validate the tier's config params with the launcher's parsers."""
    from p2pkv.settings import load_settings

    unknown = sorted(set(params) - set(TIER_OPTIONS) - {"locality"})
    if unknown:
        raise ConfigError(
            f"P2PKVTier: unknown option(s) {unknown}; valid: {sorted(TIER_OPTIONS)} (the "
            "identity comes from vLLM's offloading spec, not from tier options)")
    flags = dict(TIER_DEFAULTS)
    flags.update({k: v for k, v in params.items() if k not in _TIER_ONLY})
    peers = params.get("peers", ())
    if isinstance(peers, str) or not isinstance(peers, Sequence):
        raise ConfigError(f"P2PKVTier: peers must be a list of tcp://HOST:PORT addresses, "
                          f"got {peers!r}")
    flags["peer"] = list(peers)
    waits = TierWaits(
        reconnect=_own(params, "reconnect_interval"),
        refused_retry=_own(params, "refused_retry_interval"),
        drain_grace=_own(params, "drain_grace"), identity=_own(params, "identity_timeout"),
        lookup_wait=_own(params, "lookup_wait"), pending_wait=_own(params, "pending_wait"))
    try:
        settings = load_settings(flags, environ={})
        for address in settings["peer"]:
            validate_address(address, what="peers entry")
        validate_address(settings["listen"], what="listen")
        if settings["advertise"] is not None:
            validate_address(settings["advertise"], what="advertise")
    except ConfigError as exc:
        raise tier_error(exc) from None
    _check_bindable(settings["listen"])
    return settings, tuple(settings["peer"]), waits


def tier_node_config(settings: Any) -> Any:
    """The node's configuration from validated tier settings; its errors (CURVE key
    files, for example) named as the tier names its options."""
    from p2pkv.settings import node_config

    try:
        return node_config(settings)
    except ConfigError as exc:
        raise tier_error(exc) from None


def tier_error(exc: ConfigError) -> ConfigError:
    """``exc`` as the tier says it: every option named by its tier-config key (``peers``
    for the launcher's repeated ``peer``), not by the launcher flag it shares a parser
    with, and without the origin (always the tier config)."""
    text = exc.render(_tier_name, with_origin=False)
    option = None if exc.option is None else _tier_name(exc.option)
    return ConfigError(f"P2PKVTier: {text}", option=option, named=False)


def _tier_name(name: str) -> str:
    return "peers" if name == "peer" else name


def load_policy_config(params: Mapping[str, Any]) -> LoadPolicyConfig:
    """The ``load_*`` options: when a hit is worth loading (see
    :mod:`p2pkv.integrations.vllm.loadpolicy`)."""
    return LoadPolicyConfig(
        enabled=_own(params, "load_policy"), min_tokens=_own(params, "load_min_tokens"),
        min_speedup=_own(params, "load_min_speedup"),
        probe_interval=_own(params, "load_probe_interval"),
        probe_chunks=_own(params, "load_probe_chunks"),
        probe_budget=_own(params, "load_probe_budget"))


def _own(params: Mapping[str, Any], name: str) -> Any:
    """The tier-only option ``name`` of ``params`` (its default when absent or null, as
    for the node's options), checked by the table; a bad value is refused in the tier's
    words."""
    opt = option(name)
    if params.get(name) is None:
        return opt.default
    return opt.check(params[name], spell=lambda n: f"P2PKVTier: {n}")


def _check_bindable(listen: str) -> None:
    """Fail at engine start, not at the first request, when ``listen`` is taken.

    The node binds later (its identity needs vLLM's block-hash seed, known only once the
    engine core runs); a test bind now catches a port in use or a foreign address."""
    host, _, port = listen[len("tcp://"):].rpartition(":")
    if port == "0":
        return
    host = host.strip("[]")
    host = "0.0.0.0" if host in ("*", "") else host
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise ConfigError(f"P2PKVTier: listen {listen!r} cannot be bound: {exc}") from None


def kv_transfer_config(tier: Mapping[str, Any], *, cpu_bytes_to_use: int,
                       block_size: int | None = None, **extra: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` (or ``KVTransferConfig(**...)``) that turns p2pkv
    on: :class:`P2PKVConnector` (vLLM's offloading connector that hands the tier the
    engine's configuration and each request's adapter), :class:`P2PKVTieringSpec` with a
    primary region of ``cpu_bytes_to_use`` bytes in chunks of ``block_size`` tokens
    (default: vLLM's block size), and one :class:`P2PKVTier` with the options in
    ``tier``. ``extra`` goes into ``kv_connector_extra_config`` as is."""
    config: dict[str, Any] = {
        "spec_name": "P2PKVTieringSpec",
        "spec_module_path": "p2pkv.integrations.vllm",
        "cpu_bytes_to_use": cpu_bytes_to_use,
        "secondary_tiers": [
            {"type": "P2PKVTier", "module_path": "p2pkv.integrations.vllm", **tier}],
        **extra,
    }
    if block_size is not None:
        config["block_size"] = block_size
    return {**CONNECTOR_CONFIG, "kv_role": "kv_both", "kv_connector_extra_config": config}

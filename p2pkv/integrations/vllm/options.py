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

#: Tier-config keys taken by this tier (the node options keep their ``serve`` names;
#: see docs/configuration.md). Identity options are absent on purpose: the identity is
#: vLLM's own, read from the offloading spec.
TIER_OPTIONS: tuple[str, ...] = (
    "listen", "peers", "pool_blocks", "checksums", "parallel_agnostic",
    "handshake_timeout", "lookup_timeout", "fetch_timeout", "heartbeat_timeout",
    "curve_secret_key", "curve_authorized", "curve_server_key", "reconnect_interval",
    "identity_policy", "kv_memory_layout", "model_revision", "model_overrides",
    "directory", "directory_ttl", "advertise", "shm", "shm_copy_threads", "data_streams",
    "data_encryption",
    "identity_timeout",
    "drain_timeout",
    "refused_retry_interval", "drain_grace", "load_policy", "load_min_tokens",
    "load_min_speedup", "load_probe_interval", "load_probe_chunks", "load_probe_budget",
    "lookup_wait", "pending_wait",
)
_DEFAULT_RECONNECT = 2.0
#: Seconds before a peer that refused the handshake is tried again (the configuration
#: of one side must change first).
DEFAULT_REFUSED_RETRY = 30.0
#: Seconds ``drain_jobs`` waits beyond ``fetch_timeout`` (a load fails at its deadline;
#: a store is one copy).
DEFAULT_DRAIN_GRACE = 5.0
#: Seconds a store may wait for the weights digest before it is dropped (the first start
#: of a large checkpoint hashes it; later starts read the digest cache).
DEFAULT_IDENTITY_TIMEOUT = 600.0
#: Seconds per scheduler step the scheduler thread may wait for the answers of lookups
#: asked when their requests arrived (a peer on the same network answers in about a
#: millisecond; a step under load takes a forward pass, which a RETRY costs whole).
DEFAULT_LOOKUP_WAIT = 0.05
#: Seconds a request may wait in all for chunks a peer (or this engine) is computing
#: before it computes them itself (pending-v1); the load policy stops it sooner when
#: waiting would be slower than computing.
DEFAULT_PENDING_WAIT = 10.0
_TIER_ONLY = ("peers", "reconnect_interval", "locality", "identity_timeout",
              "refused_retry_interval", "drain_grace", "load_policy", "load_min_tokens",
              "load_min_speedup", "load_probe_interval", "load_probe_chunks",
              "load_probe_budget", "lookup_wait", "pending_wait")
#: Defaults that differ from ``serve``'s: a scheduler waits on lookups, so silence
#: becomes a miss sooner; a load that takes longer than recomputing is not worth waiting.
TIER_DEFAULTS: Mapping[str, Any] = {"lookup_timeout": 1.0, "fetch_timeout": 10.0}


@dataclass(frozen=True)
class TierWaits:
    """The tier's own waits (seconds), beside the node's deadlines in its settings."""

    reconnect: float = _DEFAULT_RECONNECT
    refused_retry: float = DEFAULT_REFUSED_RETRY
    drain_grace: float = DEFAULT_DRAIN_GRACE
    identity: float = DEFAULT_IDENTITY_TIMEOUT
    lookup_wait: float = DEFAULT_LOOKUP_WAIT
    pending_wait: float = DEFAULT_PENDING_WAIT


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
        reconnect=_positive_seconds(params, "reconnect_interval", _DEFAULT_RECONNECT),
        refused_retry=_positive_seconds(params, "refused_retry_interval",
                                        DEFAULT_REFUSED_RETRY),
        drain_grace=_positive_seconds(params, "drain_grace", DEFAULT_DRAIN_GRACE),
        identity=_positive_seconds(params, "identity_timeout", DEFAULT_IDENTITY_TIMEOUT),
        lookup_wait=_seconds(params, "lookup_wait", DEFAULT_LOOKUP_WAIT),
        pending_wait=_seconds(params, "pending_wait", DEFAULT_PENDING_WAIT))
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
    default = LoadPolicyConfig()
    enabled = params.get("load_policy", default.enabled)
    if not isinstance(enabled, bool):
        raise ConfigError(f"P2PKVTier: load_policy must be true or false, got {enabled!r}")
    counts = {}
    for name, least in (("load_min_tokens", 0), ("load_probe_chunks", 1)):
        value = params.get(name, getattr(default, name[len("load_"):]))
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"P2PKVTier: {name} must be an integer >= {least}, got "
                              f"{value!r}")
        counts[name] = value
    speedup = params.get("load_min_speedup", default.min_speedup)
    if (isinstance(speedup, bool) or not isinstance(speedup, (int, float))
            or not 0 < speedup < float("inf")):
        raise ConfigError(f"P2PKVTier: load_min_speedup must be a positive number (how many "
                          f"times faster than recomputing a load must be), got {speedup!r}")
    budget = params.get("load_probe_budget", default.probe_budget)
    if (isinstance(budget, bool) or not isinstance(budget, (int, float))
            or not 0 <= budget < float("inf")):
        raise ConfigError(f"P2PKVTier: load_probe_budget must be a number >= 0 (the fraction "
                          f"of a request's recompute time a probe may add), got {budget!r}")
    return LoadPolicyConfig(
        enabled=enabled, min_tokens=counts["load_min_tokens"], min_speedup=float(speedup),
        probe_interval=_positive_seconds(params, "load_probe_interval",
                                         default.probe_interval),
        probe_chunks=counts["load_probe_chunks"], probe_budget=float(budget))


def _positive_seconds(params: Mapping[str, Any], name: str, default: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"P2PKVTier: {name} must be a positive number of seconds, got "
                          f"{value!r}")
    return float(value)


def _seconds(params: Mapping[str, Any], name: str, default: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 <= value < float("inf"):
        raise ConfigError(f"P2PKVTier: {name} must be a number of seconds >= 0, got "
                          f"{value!r}")
    return float(value)


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

"""Every option a p2pkv node takes, declared once: name, kind, default, bounds, unit and
meaning (:data:`OPTIONS`).

The entry points take their defaults and their checks from here: the command line's
flags, the TOML file and the ``P2PKV_*`` environment (:mod:`p2pkv.settings`), the vLLM
tier's options (:mod:`p2pkv.integrations.vllm.options`), :class:`~p2pkv.NodeConfig`,
and the protocol's :class:`~p2pkv.protocol.limits.Deadlines` and
:class:`~p2pkv.protocol.limits.Limits`. A bad value is refused where it is given, by the
name it was given under, with the bound it breaks: not a number, nan, an infinity (every
wait is bounded: at most :data:`MAX_SECONDS`), a negative, zero where zero means
nothing, more than the protocol allows, a wrong type.

Values given as text (a flag, a variable) are read first (:meth:`Option.parse`); values
given typed (Python, TOML, JSON) must already have their type (:meth:`Option.check`),
except that a whole number is a number of seconds.

No IO (pure).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from p2pkv.checksum import MAX_COPY_THREADS
from p2pkv.errors import ConfigError
from p2pkv.identity import IDENTITY_POLICIES, canonical_model_overrides
from p2pkv.protocol.codes import MAX_IN_FLIGHT, MAX_KEYS, MAX_STREAMS

__all__ = ["MAX_IN_FLIGHT_LIMIT", "MAX_SECONDS", "NODE", "OPTIONS", "SERVE", "TIER", "Bool",
           "Choice", "Int", "JsonObject", "Kind", "Number", "Option", "Seconds", "Text",
           "TextList", "defaults", "heartbeat_interval", "option", "seconds"]

#: The most unfinished requests per peer a node may allow (its default: the protocol's
#: ``MAX_IN_FLIGHT``).
MAX_IN_FLIGHT_LIMIT: Final = 2**20
#: The longest wait any option may set (one day): every wait of a node is bounded.
MAX_SECONDS: Final = 86_400.0

#: Where an option is taken (:attr:`Option.where`): ``p2pkv-node``'s flags, file and
#: environment; :class:`~p2pkv.NodeConfig`; the vLLM tier's options.
SERVE: Final = "serve"
NODE: Final = "node"
TIER: Final = "tier"


class Kind:
    """What values an option takes: :meth:`check` a typed value, :meth:`read` text."""

    unit = ""

    def check(self, value: Any) -> Any:
        """``value`` as the option holds it; ValueError saying what it must be."""
        raise NotImplementedError

    def read(self, text: str) -> Any:
        """``text`` (a flag's or a variable's) as a typed value, then :meth:`check`."""
        return self.check(text.strip())

    def describe(self) -> str:
        """The bound in words, as the docs' table gives it."""
        raise NotImplementedError


def _got(value: Any) -> str:
    return f"got {value!r}"


@dataclass(frozen=True)
class Number(Kind):
    """A finite number in [``least``, ``most``]; ``least`` itself only if
    ``least_ok``."""

    least: float = 0.0
    least_ok: bool = False
    most: float = math.inf
    what: str = "a number"

    def check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be {self._low()}, {_got(value)}")
        number = float(value)
        if not math.isfinite(number) or number < self.least or \
                (number == self.least and not self.least_ok):
            raise ValueError(f"must be {self._low()}, {_got(value)}")
        if number > self.most:
            raise ValueError(f"must be at most {self.most:g}{self.unit}, {_got(value)}")
        return number

    def read(self, text: str) -> float:
        try:
            number = float(text.strip())
        except ValueError:
            raise ValueError(f"must be {self.what}, {_got(text)}") from None
        return self.check(number)

    def _low(self) -> str:
        if self.least == 0 and not self.least_ok:
            return self.what.replace("a ", "a positive ", 1)
        return f"{self.what} {'>=' if self.least_ok else '>'} {self.least:g}"

    def describe(self) -> str:
        high = "" if math.isinf(self.most) else f", at most {self.most:g}{self.unit}"
        return f"{self._low()}{high}"


@dataclass(frozen=True)
class Seconds(Number):
    """A wait: finite, at most :data:`MAX_SECONDS`, above zero unless ``least_ok``."""

    most: float = MAX_SECONDS
    what: str = "a number of seconds"
    unit = " s"


@dataclass(frozen=True)
class Int(Kind):
    """An integer in [``least``, ``most``] (text: decimal, or 0x... hex)."""

    least: int = 0
    most: int = 2**63 - 1

    def check(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, {_got(value)}")
        if not self.least <= value <= self.most:
            raise ValueError(f"must be in [{self.least}, {self.most}], got {value}")
        return value

    def read(self, text: str) -> int:
        try:
            number = int(text.strip(), 0)
        except ValueError:
            raise ValueError(f"must be an integer, {_got(text)}") from None
        return self.check(number)

    def describe(self) -> str:
        return f"an integer in [{self.least}, {self.most}]"


@dataclass(frozen=True)
class Bool(Kind):
    """true or false (text: 1/true/yes/on, 0/false/no/off)."""

    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, {_got(value)}")
        return value

    def read(self, text: str) -> bool:
        word = text.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"must be true or false, {_got(text)}")

    def describe(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Choice(Kind):
    """One of ``choices`` (text: case and surrounding blanks do not matter)."""

    choices: tuple[str, ...] = ()

    def check(self, value: Any) -> str:
        if value not in self.choices:
            raise ValueError(f"must be {self.describe()}, {_got(value)}")
        return str(value)

    def read(self, text: str) -> str:
        word = text.strip().lower()
        if word not in self.choices:
            raise ValueError(f"must be {self.describe()}, {_got(text)}")
        return word

    def describe(self) -> str:
        return "one of " + ", ".join(self.choices)


@dataclass(frozen=True)
class Text(Kind):
    """A non-empty string (surrounding blanks removed)."""

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"must be a non-empty string, {_got(value)}")
        return value.strip()

    def describe(self) -> str:
        return "a non-empty string"


@dataclass(frozen=True)
class TextList(Kind):
    """A list of non-empty strings (text: comma-separated)."""

    def check(self, value: Any) -> tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ValueError(f"must be a list of strings, {_got(value)}")
        return tuple(Text().check(v) for v in value)

    def read(self, text: str) -> tuple[str, ...]:
        return tuple(v.strip() for v in text.split(",") if v.strip())

    def describe(self) -> str:
        return "a list of strings"


@dataclass(frozen=True)
class JsonObject(Kind):
    """A JSON object (text: JSON; typed: a mapping), every value with a canonical form
    (:func:`~p2pkv.identity.canonical_model_overrides`)."""

    def check(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a JSON object, got {type(value).__name__} {value!r}")
        canonical_model_overrides(value)  # ValueError naming the value without one
        return dict(value)

    def read(self, text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be a JSON object, got invalid JSON ({exc})") from None
        return self.check(value)

    def describe(self) -> str:
        return "a JSON object"


@dataclass(frozen=True)
class Option:
    """One option: its canonical name (the TOML key, the tier's key, the ``NodeConfig``
    field; the flag and variable derive from it), kind, default (None: unset), where it
    is taken, and what it means."""

    name: str
    kind: Kind
    default: Any
    help: str
    where: frozenset[str] = frozenset({SERVE, NODE, TIER})
    #: The vLLM tier's default where it differs (a scheduler waits on lookups, so
    #: silence becomes a miss sooner; a load slower than recomputing is not worth it).
    tier_default: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "P2PKV_" + self.name.upper()

    def check(self, value: Any, *, spell: Callable[[str], str] | None = None) -> Any:
        """A typed value checked (a whole number is a number of seconds). ConfigError
        names the option: as ``spell`` spells it in the text, or as data only
        (``option``, rendered by each front end its own way) without ``spell``."""
        try:
            return self.kind.check(value)
        except ValueError as exc:
            raise self._error(str(exc), spell) from None

    def parse(self, value: Any, *, spell: Callable[[str], str] | None = None) -> Any:
        """A value that may be text (a flag, a variable) read and checked."""
        try:
            return self.kind.read(value) if isinstance(value, str) else self.kind.check(value)
        except ValueError as exc:
            raise self._error(str(exc), spell) from None

    def _error(self, detail: str, spell: Callable[[str], str] | None) -> ConfigError:
        if spell is None:
            return ConfigError(detail, option=self.name)
        return ConfigError(f"{spell(self.name)} {detail}", option=self.name, named=False)


_ALL = frozenset({SERVE, NODE, TIER})
_SERVE = frozenset({SERVE})
_SERVE_NODE = frozenset({SERVE, NODE})
_SERVE_TIER = frozenset({SERVE, TIER})
_NODE = frozenset({NODE})
_TIER = frozenset({TIER})


def _seconds(name: str, default: float | None, help: str, where: frozenset[str] = _ALL, *,
             zero_ok: bool = False, tier_default: float | None = None) -> Option:
    return Option(name, Seconds(least_ok=zero_ok), default, help, where, tier_default)


#: Every option, in the order ``p2pkv-node --help`` lists the command line's.
OPTIONS: tuple[Option, ...] = (
    # -- the KV identity and geometry (p2pkv-node; the tier takes vLLM's own) -------------
    Option("model", Text(), "p2pkv/demo-seed", "model name (part of the identity)", _SERVE),
    Option("layout", Choice(("v1", "v2", "replicated")), "v2",
           "KV layout: v1 cross-layer, v2 per-layer, replicated (MLA)", _SERVE),
    Option("preset", Text(), None, "built-in geometry preset (seed, llama-3-8b, ...)", _SERVE),
    Option("model_config", Text(), None,
           "local Hugging Face style config.json for the geometry", _SERVE),
    Option("model_path", Text(), None,
           "the checkpoint this node's KV comes from (a directory or a weight file): its "
           "weights and config.json are hashed into the identity (model_weights, "
           "model_config); its config.json also gives the geometry", _SERVE),
    Option("layers", Int(1, 4096), None, "number of layers", _SERVE),
    Option("kv_heads", Int(1, 4096), None, "KV heads per rank", _SERVE),
    Option("head_dim", Int(1, 65536), None, "head size (MLA: latent size)", _SERVE),
    Option("kv_kind", Choice(("mha", "mla")), None,
           "KV cache kind: mha (K and V per head) or mla (one latent per token)", _SERVE),
    Option("block_tokens", Int(1, 65536), 16, "tokens per KV block", _SERVE),
    Option("tokens_per_hash", Int(1, 65536), None,
           "tokens per block hash (default: --block-tokens)", _SERVE),
    Option("dtype", Choice(("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")),
           None, "KV cache element type", _SERVE),
    Option("tp", Int(1, 4096), 1, "tensor-parallel size", _SERVE),
    Option("pp", Int(1, 4096), 1, "pipeline-parallel size", _SERVE),
    Option("rank", Int(0, 1 << 20), 0, "this worker's rank (never hashed)", _SERVE),
    Option("parallel_agnostic", Bool(), True,
           "opt in to sharing across parallel layouts where the layout allows it", _SERVE_TIER),
    Option("key_seed", Int(0, 2**64 - 1), 0,
           "seed of the block-key hash (peers must agree)",
           _SERVE_NODE),
    Option("kv_memory_layout", Text(), None,
           "identity extension: byte order of a block in the engine's memory (NHD, HND, ...)",
           _SERVE_TIER),
    Option("model_revision", Text(), None, "identity extension: the weights revision",
           _SERVE_TIER),
    Option("model_overrides", JsonObject(), None,
           "identity extension: JSON object of the overrides that change K/V values",
           _SERVE_TIER),
    Option("identity_policy", Choice(IDENTITY_POLICIES), "strict",
           "an identity field only one side declares: strict refuses, lenient warns"),
    # -- the node ----------------------------------------------------------------------
    Option("pool_blocks", Int(1, 1 << 30), 256, "blocks in the host pool", _SERVE_TIER),
    Option("fill", Int(0, 1 << 24), 0,
           "serve: start holding N blocks of known content (protocol/SPEC.md appendix A)",
           _SERVE),
    Option("listen", Text(), "tcp://127.0.0.1:0", "address to serve on (port 0: ephemeral)"),
    Option("peer", TextList(), (),
           "peer address to connect to at start (repeatable)", _SERVE_TIER),
    _seconds("handshake_timeout", 5.0, "seconds to wait for a handshake"),
    _seconds("lookup_timeout", 5.0, "seconds to wait for a lookup answer", tier_default=1.0),
    _seconds("fetch_timeout", 60.0, "seconds a whole fetch may take", tier_default=10.0),
    _seconds("fetch_idle_timeout", 10.0,
             "seconds a fetch may go without progress before it is aborted", _SERVE_NODE),
    _seconds("send_timeout", 20.0,
             "seconds a peer may take nothing of what waits for it on its data path (its "
             "data stream, its ZeroMQ frames, its shared-memory pins); then its session "
             "ends and the blocks are released", _SERVE_NODE),
    _seconds("abort_timeout", 2.0,
             "seconds a peer gets to confirm an abort before it is disconnected", _SERVE_NODE),
    _seconds("drain_timeout", 10.0,
             "serve: on SIGTERM/SIGINT, seconds in-flight sends get to finish after the node "
             "left the directory and began declining new fetches"),
    _seconds("close_timeout", 5.0, "seconds in-flight work gets to finish when the node stops",
             _SERVE_NODE),
    _seconds("heartbeat_interval", None,
             "seconds without traffic before a ping (default: the smaller of 1 and a "
             "quarter of --heartbeat-timeout)", _SERVE_NODE),
    _seconds("heartbeat_timeout", 5.0, "seconds of silence before a peer is dead"),
    Option("checksums", Bool(), True, "offer per-block xxh3-64 checksums"),
    Option("directory", Text(), "static",
           "cluster directory: static (the --peer list), redis://HOST:PORT/DB, "
           "redis+cluster://HOST:PORT[,...] or redis+sentinel://HOST:PORT[,...]/SERVICE",
           _SERVE_TIER),
    Option("advertise", Text(), None,
           "address registered in the directory (default: --listen, a wildcard host "
           "replaced by this host's address)", _SERVE_TIER),
    _seconds("directory_ttl", 10.0, "seconds a Redis registration lives without a heartbeat",
             _SERVE_TIER),
    Option("shm", Bool(), False,
           "same-host shared memory (shm-v1): the pool lives in /dev/shm and blocks are "
           "copied from same-host peers' pools"),
    Option("shm_copy_threads", Int(1, MAX_COPY_THREADS), 1,
           "threads that copy and verify one shared-memory message's blocks at once "
           "(above 1 needs the compiled helper; else one)"),
    Option("nixl", Choice(("auto", "on", "off")), "auto",
           "one-sided reads through NIXL (nixl-v1): auto uses them where this host has an "
           "RDMA device and NIXL is installed, on wherever NIXL is installed (an error "
           "where it is not), off never; never under CURVE (UCX moves bytes in the clear)"),
    _seconds("nixl_read_timeout", 2.0,
             "seconds one NIXL read may take; a read that does not complete by then fails "
             "the blocks it carries, not the connection"),
    Option("data_channel", Bool(), True,
           "offer the data channel: block bytes on a TCP stream beside the ZeroMQ "
           "connection, bound to the session by a token (tcp-data-v1; under CURVE "
           "encrypted, see --data-encryption)", _SERVE_NODE),
    Option("data_streams", Int(1, MAX_STREAMS), 1,
           "data streams per peer (tcp-streams-v1): this node opens up to N to each "
           "peer and accepts up to N from each; a fetch is striped over them"),
    Option("data_encryption", Choice(("sealed", "tls")), "sealed",
           "how data streams are encrypted under CURVE: sealed (AES-256-GCM records "
           "keyed from the CURVE session, tcp-data-aead-v1, with TLS 1.3 for peers that "
           "only speak that) or tls (TLS 1.3 only, tcp-data-tls-v1)"),
    Option("data_port", Int(0, 65535), 0,
           "port the data channel listens on, at the host of --listen (0: ephemeral)",
           _SERVE_NODE),
    Option("metrics_port", Int(0, 65535), None, "serve Prometheus metrics on this port", _SERVE),
    Option("metrics_host", Text(), "127.0.0.1",
           "address the metrics endpoint listens on (0.0.0.0: every interface)", _SERVE),
    Option("curve_secret_key", Text(), None, "CURVE secret key file (enables encryption)",
           _SERVE_TIER),
    Option("curve_authorized", Text(), None, "directory of authorized client public keys",
           _SERVE_TIER),
    Option("curve_server_key", Text(), None, "server public key file (client side)",
           _SERVE_TIER),
    Option("log_level", Choice(("debug", "info", "warning", "error")), "warning",
           "log level (stderr)", _SERVE),
    # -- NodeConfig's own (the protocol's Limits take the first two) ---------------------
    Option("max_keys_per_request", Int(1, MAX_KEYS), MAX_KEYS,
           "most keys per lookup or fetch this node serves (at most the protocol's)", _NODE),
    Option("max_inflight_requests", Int(1, MAX_IN_FLIGHT_LIMIT), MAX_IN_FLIGHT,
           "most unfinished requests per peer", _NODE),
    Option("max_peers", Int(1, 1 << 16), 256, "most connected peers", _NODE),
    Option("window_bytes", Int(1, 1 << 40), 16 << 20,
           "the credit window of one peer's fetches, in bytes", _NODE),
    Option("packed_blocks", Bool(), True,
           "offer packed-v1: blocks of small segments travel as one frame per message", _NODE),
    _seconds("close_grace", 5.0, "seconds close() waits for the IO thread beyond close_timeout",
             _NODE),
    # -- the vLLM tier's own -------------------------------------------------------------
    _seconds("reconnect_interval", 2.0, "seconds between tries to reach a static peer", _TIER),
    _seconds("refused_retry_interval", 30.0,
             "seconds before a peer that refused the handshake is tried again (the "
             "configuration of one side must change first)", _TIER),
    _seconds("drain_grace", 5.0,
             "seconds drain_jobs waits beyond fetch_timeout (a load fails at its deadline; "
             "a store is one copy)", _TIER),
    _seconds("identity_timeout", 600.0,
             "seconds a store may wait for the weights digest before it is dropped (the "
             "first start of a large checkpoint hashes it)", _TIER),
    _seconds("lookup_wait", 0.05,
             "seconds per scheduler step the scheduler may wait for the answers of lookups "
             "asked when their requests arrived (0: never wait)", _TIER, zero_ok=True),
    _seconds("pending_wait", 10.0,
             "seconds a request may wait in all for chunks a peer (or this engine) is "
             "computing before it computes them itself (0: never wait)", _TIER,
             zero_ok=True),
    Option("load_policy", Bool(), True,
           "load a hit only when loading it is faster than recomputing it", _TIER),
    Option("load_min_tokens", Int(0, 1 << 30), 0,
           "a hit of fewer tokens than this is always recomputed", _TIER),
    Option("load_min_speedup", Number(0.0, most=1e6), 1.2,
           "how many times faster than recomputing a load must be", _TIER),
    _seconds("load_probe_interval", 30.0, "seconds after which a peer found slow is probed",
             _TIER),
    Option("load_probe_chunks", Int(1, 1 << 20), 1, "chunks a probe loads", _TIER),
    Option("load_probe_budget", Number(0.0, least_ok=True, most=1e6, what="a fraction"), 0.05,
           "the share of a request's estimated recompute time a probe may add", _TIER),
)

_BY_NAME: Mapping[str, Option] = {o.name: o for o in OPTIONS}


def option(name: str) -> Option:
    """The option named ``name`` (KeyError for a name no entry point takes)."""
    return _BY_NAME[name]


def heartbeat_interval(timeout: float, interval: float | None = None, *,
                       spell: Callable[[str], str] | None = None) -> float:
    """The ping interval for ``timeout``: ``interval`` when given, which must be shorter
    (ConfigError naming both as ``spell`` spells them, or as data); by default the
    smaller of 1 s and a quarter of the timeout."""
    if interval is None:
        return min(1.0, timeout / 4)
    if interval >= timeout:
        if spell is None:
            raise ConfigError(f"must be shorter than {{heartbeat_timeout}} ({timeout:g}), "
                              f"got {interval:g}", option="heartbeat_interval",
                              mentions=("heartbeat_timeout",))
        raise ConfigError(f"{spell('heartbeat_interval')} ({interval:g}) must be shorter than "
                          f"{spell('heartbeat_timeout')} ({timeout:g})",
                          option="heartbeat_interval", named=False)
    return interval


def defaults(where: str) -> dict[str, Any]:
    """Each option taken at ``where`` (:data:`SERVE`, :data:`NODE`, :data:`TIER`) with
    its default there."""
    return {o.name: o.tier_default if where == TIER and o.tier_default is not None
            else o.default for o in OPTIONS if where in o.where}


def seconds(value: Any, name: str, *, zero_ok: bool = False) -> float:
    """``value`` as a wait named ``name`` outside the table (a class's own field): the
    rule every option's wait follows (finite, at most :data:`MAX_SECONDS`, above zero
    unless ``zero_ok``); ConfigError ``name must be ...``."""
    try:
        return Seconds(least_ok=zero_ok).check(value)
    except ValueError as exc:
        raise ConfigError(f"{name} {exc}", option=name, named=False) from None

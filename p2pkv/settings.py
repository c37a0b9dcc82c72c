"""Node settings from flags, a TOML file and ``P2PKV_*`` environment variables.

Precedence: command-line flag > environment variable > TOML file > built-in default.
Every option has one canonical name (``tp``, ``pool_blocks``, ...): the flag is
``--tp``/``--pool-blocks``, the variable ``P2PKV_TP``/``P2PKV_POOL_BLOCKS`` and the TOML
key ``tp``/``pool_blocks`` (top level, or under a ``[node]`` table). A bad value raises
:class:`~p2pkv.errors.ConfigError` that names the option as data (``option``); its
message starts with the option's flag, and the vLLM tier spells it as its own key.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pkv.errors import ConfigError
from p2pkv.identity import (
    IDENTITY_POLICIES,
    IdentityExtension,
    RunConfig,
    canonical_model_overrides,
    model_overrides_digest,
)
from p2pkv.runtime.config import NodeConfig
from p2pkv.transport import CurveKeys, load_authorized_keys, validate_address

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

__all__ = ["OPTIONS", "Option", "Settings", "load_settings", "node_config"]

DEFAULT_MODEL = "p2pkv/demo-seed"


def _int(minimum: int, maximum: int = 2**63 - 1) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError(f"must be an integer, got {value!r}")
        if isinstance(value, str):
            try:
                value = int(value.strip(), 0)
            except ValueError:
                raise ValueError(f"must be an integer, got {value!r}") from None
        if not isinstance(value, int):
            raise ValueError(f"must be an integer, got {value!r}")
        if not minimum <= value <= maximum:
            raise ValueError(f"must be in [{minimum}, {maximum}], got {value}")
        return value

    return parse


def _seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"must be a number of seconds, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be a number of seconds, got {value!r}") from None
    if not number > 0 or number != number or number == float("inf"):
        raise ValueError(f"must be a positive number of seconds, got {value!r}")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {value!r}")


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a non-empty string, got {value!r}")
    return value.strip()


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        # Case and surrounding blanks do not matter (P2PKV_LOG_LEVEL=INFO is common).
        name = value.strip().lower() if isinstance(value, str) else value
        if name not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
        return str(name)

    return parse


def _str_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = [_str(v) for v in value]
    else:
        raise ValueError(f"must be a list of strings, got {value!r}")
    return tuple(items)


def _json_object(value: Any) -> dict[str, Any]:
    """A JSON object given as text (flag, environment) or as a TOML table."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be a JSON object, got invalid JSON ({exc})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a JSON object, got {type(value).__name__} {value!r}")
    canonical_model_overrides(value)  # every value must have a canonical form
    return dict(value)


def _directory(value: Any) -> str:
    name = _str(value)
    if name == "static":
        return name
    from p2pkv.cluster.redis_urls import parse_directory_url

    try:
        parse_directory_url(name)
    except ConfigError as exc:
        raise ValueError(f"must be static or a Redis URL (redis://HOST:PORT/DB, "
                         f"redis+cluster://..., redis+sentinel://...): {exc}") from None
    return name


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "P2PKV_" + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("model", _str, DEFAULT_MODEL, "model name (part of the identity)"),
    Option("layout", _choice("v1", "v2", "replicated"), "v2",
           "KV layout: v1 cross-layer, v2 per-layer, replicated (MLA)"),
    Option("preset", _str, None, "built-in geometry preset (seed, llama-3-8b, ...)"),
    Option("model_config", _str, None, "local Hugging Face style config.json for the geometry"),
    Option("model_path", _str, None,
           "the checkpoint this node's KV comes from (a directory or a weight file): its "
           "weights and config.json are hashed into the identity (model_weights, "
           "model_config); its config.json also gives the geometry"),
    Option("layers", _int(1, 4096), None, "number of layers"),
    Option("kv_heads", _int(1, 4096), None, "KV heads per rank"),
    Option("head_dim", _int(1, 65536), None, "head size (MLA: latent size)"),
    Option("kv_kind", _choice("mha", "mla"), None,
           "KV cache kind: mha (K and V per head) or mla (one latent per token)"),
    Option("block_tokens", _int(1, 65536), 16, "tokens per KV block"),
    Option("tokens_per_hash", _int(1, 65536), None,
           "tokens per block hash (default: --block-tokens)"),
    Option("dtype", _choice("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"),
           None, "KV cache element type"),
    Option("tp", _int(1, 4096), 1, "tensor-parallel size"),
    Option("pp", _int(1, 4096), 1, "pipeline-parallel size"),
    Option("rank", _int(0, 1 << 20), 0, "this worker's rank (never hashed)"),
    Option("parallel_agnostic", _bool, True,
           "opt in to sharing across parallel layouts where the layout allows it"),
    Option("key_seed", _int(0, 2**64 - 1), 0, "seed of the block-key hash (peers must agree)"),
    Option("kv_memory_layout", _str, None,
           "identity extension: byte order of a block in the engine's memory (NHD, HND, ...)"),
    Option("model_revision", _str, None, "identity extension: the weights revision"),
    Option("model_overrides", _json_object, None,
           "identity extension: JSON object of the overrides that change K/V values"),
    Option("identity_policy", _choice(*IDENTITY_POLICIES), "strict",
           "an identity field only one side declares: strict refuses, lenient warns"),
    Option("pool_blocks", _int(1, 1 << 30), 256, "blocks in the host pool"),
    Option("fill", _int(0, 1 << 24), 0,
           "serve: start holding N blocks of known content (protocol/SPEC.md appendix A)"),
    Option("listen", _str, "tcp://127.0.0.1:0", "address to serve on (port 0: ephemeral)"),
    Option("peer", _str_list, (), "peer address to connect to at start (repeatable)"),
    Option("handshake_timeout", _seconds, 5.0, "seconds to wait for a handshake"),
    Option("lookup_timeout", _seconds, 5.0, "seconds to wait for a lookup answer"),
    Option("fetch_timeout", _seconds, 60.0, "seconds a whole fetch may take"),
    Option("fetch_idle_timeout", _seconds, 10.0,
           "seconds a fetch may go without progress before it is aborted"),
    Option("send_timeout", _seconds, 20.0,
           "seconds a peer may take nothing of what waits for it on its data path (its "
           "data stream, its ZeroMQ frames, its shared-memory pins); then its session "
           "ends and the blocks are released"),
    Option("abort_timeout", _seconds, 2.0,
           "seconds a peer gets to confirm an abort before it is disconnected"),
    Option("drain_timeout", _seconds, 10.0,
           "serve: on SIGTERM/SIGINT, seconds in-flight sends get to finish after the node "
           "left the directory and began declining new fetches"),
    Option("close_timeout", _seconds, 5.0,
           "seconds in-flight work gets to finish when the node stops"),
    Option("heartbeat_interval", _seconds, None,
           "seconds without traffic before a ping (default: the smaller of 1 and a "
           "quarter of --heartbeat-timeout)"),
    Option("heartbeat_timeout", _seconds, 5.0, "seconds of silence before a peer is dead"),
    Option("checksums", _bool, True, "offer per-block xxh3-64 checksums"),
    Option("directory", _directory, "static",
           "cluster directory: static (the --peer list), redis://HOST:PORT/DB, "
           "redis+cluster://HOST:PORT[,...] or redis+sentinel://HOST:PORT[,...]/SERVICE"),
    Option("advertise", _str, None,
           "address registered in the directory (default: --listen, a wildcard host "
           "replaced by this host's address)"),
    Option("directory_ttl", _seconds, 10.0,
           "seconds a Redis registration lives without a heartbeat"),
    Option("shm", _bool, False,
           "same-host shared memory (shm-v1): the pool lives in /dev/shm and blocks are "
           "copied from same-host peers' pools"),
    Option("shm_copy_threads", _int(1, 8), 1,
           "threads that copy and verify one shared-memory message's blocks at once "
           "(above 1 needs the compiled helper; else one)"),
    Option("data_channel", _bool, True,
           "offer the data channel: block bytes on a TCP stream beside the ZeroMQ "
           "connection, bound to the session by a token (tcp-data-v1; under CURVE "
           "encrypted, see --data-encryption)"),
    Option("data_streams", _int(1, 8), 1,
           "data streams per peer (tcp-streams-v1): this node opens up to N to each "
           "peer and accepts up to N from each; a fetch is striped over them"),
    Option("data_encryption", _choice("sealed", "tls"), "sealed",
           "how data streams are encrypted under CURVE: sealed (AES-256-GCM records "
           "keyed from the CURVE session, tcp-data-aead-v1, with TLS 1.3 for peers that "
           "only speak that) or tls (TLS 1.3 only, tcp-data-tls-v1)"),
    Option("data_port", _int(0, 65535), 0,
           "port the data channel listens on, at the host of --listen (0: ephemeral)"),
    Option("metrics_port", _int(0, 65535), None, "serve Prometheus metrics on this port"),
    Option("metrics_host", _str, "127.0.0.1",
           "address the metrics endpoint listens on (0.0.0.0: every interface)"),
    Option("curve_secret_key", _str, None, "CURVE secret key file (enables encryption)"),
    Option("curve_authorized", _str, None, "directory of authorized client public keys"),
    Option("curve_server_key", _str, None, "server public key file (client side)"),
    Option("log_level", _choice("debug", "info", "warning", "error"), "warning",
           "log level (stderr)"),
)
_BY_NAME = {o.name: o for o in OPTIONS}
#: How many --model-path identities a process keeps once hashed (the most recent).
_CHECKPOINTS_KEPT = 4


@functools.lru_cache(maxsize=_CHECKPOINTS_KEPT)  # thread-safe; a failure is not kept
def _checkpoint_identity(path: str) -> Any:
    from p2pkv.identity.checkpoint import checkpoint_identity

    return checkpoint_identity(path)


@dataclass(frozen=True)
class Settings:
    """Resolved option values (``values[name]``) and where each came from."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def geometry(self) -> Any:
        """The KV geometry: preset or config.json, then per-field flag overrides."""
        from p2pkv.layout import SEED_GEOMETRY, Geometry, geometry_from_hf_config, preset

        v = self.values
        block_tokens = v["block_tokens"]
        try:
            if v["preset"] is not None and v["model_config"] is not None:
                raise ConfigError("{preset} and {model_config} are exclusive; give one",
                                  mentions=("preset", "model_config"))
            config_file = v["model_config"]
            if config_file is None and v["preset"] is None and v["model_path"] is not None \
                    and (Path(v["model_path"]) / "config.json").is_file():
                config_file = str(Path(v["model_path"]) / "config.json")
            if config_file is not None:
                base = geometry_from_hf_config(Path(config_file),
                                               tokens_per_block=block_tokens, tp_size=v["tp"],
                                               dtype=v["dtype"])
                kv_heads = base.num_kv_heads
            else:
                base = (SEED_GEOMETRY if v["preset"] is None
                        else preset(v["preset"], tokens_per_block=block_tokens))
                kv_heads = base.num_kv_heads
            kv_kind = v["kv_kind"] or base.kv_kind
            if kv_kind == "mla" and base.kv_kind != "mla":
                kv_heads = 1  # one latent per token, whatever the base had
            if v["layout"] == "replicated" and kv_kind != "mla":
                raise ConfigError("{layout} replicated needs an MLA geometry ({kv_kind} mla, "
                                  "or e.g. {preset} deepseek-v2-lite)",
                                  mentions=("layout", "kv_kind", "preset"))
            if kv_kind == "mla" and v["kv_heads"] not in (None, 1):
                raise ConfigError(f"an MLA geometry has exactly 1 KV head, got {v['kv_heads']}",
                                  option="kv_heads")
            return Geometry(
                num_layers=v["layers"] or base.num_layers,
                num_kv_heads=v["kv_heads"] or kv_heads,
                head_size=v["head_dim"] or base.head_size,
                tokens_per_block=block_tokens,
                dtype=v["dtype"] or base.dtype,
                kv_kind=kv_kind,
            )
        except ConfigError:
            raise
        except (ValueError, OSError) as exc:
            option = "model_config" if v["model_config"] else "preset"
            raise ConfigError(str(exc), option=option) from exc

    def layout(self) -> Any:
        from p2pkv.layout import make_layout

        try:
            return make_layout(self.values["layout"], self.geometry())
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc), option="layout") from exc

    def checkpoint(self) -> Any:
        """The identity ``--model-path`` gives (None without it); the process keeps the
        identities of the last few paths it hashed, so each is hashed once."""
        path = self.values["model_path"]
        if path is None:
            return None
        from p2pkv.identity.checkpoint import CheckpointError

        try:
            return _checkpoint_identity(path)
        except CheckpointError as exc:
            raise ConfigError(str(exc), option="model_path") from None

    def extension(self) -> IdentityExtension:
        """The identity extension: what the options declare, and what ``--model-path``
        derives (a declared ``--model-revision`` must agree with a derived one)."""
        v = self.values
        overrides = v["model_overrides"]
        for name in ("kv_memory_layout", "model_revision"):
            if v[name] is not None:
                try:
                    IdentityExtension(**{name: v[name]})
                except ValueError as exc:
                    raise ConfigError(str(exc), option=name) from None
        checkpoint = self.checkpoint()
        revision = v["model_revision"]
        if checkpoint is not None and checkpoint.revision is not None:
            if revision is not None and revision != checkpoint.revision:
                raise ConfigError(f"declared {revision!r} but {{model_path}} is the Hugging "
                                  f"Face snapshot of revision {checkpoint.revision!r}",
                                  option="model_revision", mentions=("model_path",))
            revision = checkpoint.revision
        return IdentityExtension(
            kv_memory_layout=v["kv_memory_layout"],
            model_revision=revision,
            model_overrides=None if overrides is None else model_overrides_digest(overrides),
            model_weights=None if checkpoint is None else checkpoint.model_weights,
            model_config=None if checkpoint is None else checkpoint.model_config,
        )

    def identity_sources(self) -> dict[str, str]:
        """Where each identity-extension field comes from (declared or derived)."""
        v = self.values
        out = {name: f"declared ({self.sources.get(name, '--' + name.replace('_', '-'))})"
               for name in ("kv_memory_layout", "model_revision", "model_overrides")
               if v[name] is not None}
        checkpoint = self.checkpoint()
        if checkpoint is not None:
            for name, source in checkpoint.sources.items():
                out[name] = f"{source}, of {checkpoint.path}"
        return out

    def run_config(self, layout: Any | None = None) -> RunConfig:
        layout = layout or self.layout()
        g = layout.geometry
        v = self.values
        groups = [{
            "tokens_per_block": g.tokens_per_block,
            "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(g.num_layers)],
        }]
        try:
            return RunConfig.resolve(
                v["model"],
                parallel_agnostic=v["parallel_agnostic"],
                tokens_per_hash=v["tokens_per_hash"] or g.tokens_per_block,
                tp_size=v["tp"], pp_size=v["pp"], rank=v["rank"], dtype=g.dtype,
                kv_cache_groups=groups, **layout.identity_flags(),
            )
        except ValueError as exc:
            raise ConfigError(f"run config: {exc}") from exc


def load_settings(flags: Mapping[str, Any], *, config_file: str | None = None,
                  environ: Mapping[str, str] | None = None) -> Settings:
    """Merge flags (None = not given), environment and TOML into :class:`Settings`."""
    env = os.environ if environ is None else environ
    path = config_file or env.get("P2PKV_CONFIG")
    toml: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read {path!r}: {exc.strerror}",
                              option="config") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path!r} is not valid TOML: {exc}", option="config") from exc
        table = data.get("node", data)
        if not isinstance(table, dict):
            raise ConfigError(f"[node] in {path!r} must be a table", option="config")
        if table is not data:
            # With a [node] table, a key beside it would be silently ignored: refuse it.
            for key in data:
                if key != "node":
                    raise ConfigError(f"key {key!r} outside the [node] table in {path!r}; put "
                                      "every option under [node] or none", option="config")
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in _BY_NAME:
                raise ConfigError(f"unknown option {key!r} in {path!r}", option="config")
            toml[name] = value
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        raw: Any = None
        where = "default"
        if flags.get(opt.name) not in (None, [], ()):
            raw, where = flags[opt.name], opt.flag
        elif opt.env in env and env[opt.env] != "":
            raw, where = env[opt.env], opt.env
        elif opt.name in toml:
            raw, where = toml[opt.name], f"{path}:{opt.name}"
        if where == "default":
            values[opt.name] = opt.default
        else:
            try:
                values[opt.name] = opt.parse(raw)
            except ValueError as exc:
                raise ConfigError(str(exc), option=opt.name, origin=where) from None
        sources[opt.name] = where
    return Settings(values, sources)


def _certificate(values: Mapping[str, Any], option: str) -> tuple[bytes, bytes | None]:
    """The (public, secret) keys of the ZeroMQ certificate file ``option`` names."""
    import zmq.auth

    try:
        return zmq.auth.load_certificate(values[option])
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {values[option]!r}: {exc}", option=option) from exc


def node_config(settings: Settings, *, listen: str | None = None) -> NodeConfig:
    """The :class:`~p2pkv.node.NodeConfig` the options describe (CURVE keys read and
    checked, heartbeat defaults applied): one place for ``serve``, the other commands
    and the vLLM tier."""
    v = settings.values
    try:
        validate_address(listen or v["listen"], what="listen")
    except ConfigError as exc:
        raise ConfigError(str(exc), option="listen") from exc
    curve = None
    if v["curve_secret_key"] is None:
        # Never run in the clear while the operator believes CURVE is on.
        for name in ("curve_authorized", "curve_server_key"):
            if v[name] is not None:
                raise ConfigError("needs {curve_secret_key} (CURVE is off without this "
                                  "node's own key pair)", option=name,
                                  mentions=("curve_secret_key",))
    if v["curve_secret_key"] is not None:
        public, secret = _certificate(v, "curve_secret_key")
        if secret is None:
            raise ConfigError(f"{v['curve_secret_key']!r} holds no secret key (use the "
                              ".key_secret file)", option="curve_secret_key")
        server_key = None
        if v["curve_server_key"] is not None:
            server_key, _ = _certificate(v, "curve_server_key")
        authorized = None
        if v["curve_authorized"] is not None:
            try:
                authorized = load_authorized_keys(v["curve_authorized"])
            except ConfigError as exc:
                raise ConfigError(str(exc), option="curve_authorized") from exc
        curve = CurveKeys(public, secret, server_key, authorized)
    interval = v["heartbeat_interval"]
    if interval is None:
        interval = min(1.0, v["heartbeat_timeout"] / 4)
    elif interval >= v["heartbeat_timeout"]:
        raise ConfigError(f"must be shorter than {{heartbeat_timeout}} "
                          f"({v['heartbeat_timeout']:g}), got {interval:g}",
                          option="heartbeat_interval", mentions=("heartbeat_timeout",))
    try:
        return NodeConfig(
            listen=listen or v["listen"], key_hash_seed=v["key_seed"], checksums=v["checksums"],
            handshake_timeout=v["handshake_timeout"], lookup_timeout=v["lookup_timeout"],
            fetch_timeout=v["fetch_timeout"], fetch_idle_timeout=v["fetch_idle_timeout"],
            send_timeout=v["send_timeout"],
            abort_timeout=v["abort_timeout"], close_timeout=v["close_timeout"],
            drain_timeout=v["drain_timeout"], heartbeat_timeout=v["heartbeat_timeout"],
            heartbeat_interval=interval, curve=curve,
            identity_policy=v["identity_policy"], shm=v["shm"],
            shm_copy_threads=v["shm_copy_threads"],
            data_channel=v["data_channel"], data_port=v["data_port"],
            data_streams=v["data_streams"], data_encryption=v["data_encryption"],
        )
    except ConfigError as exc:
        if exc.option == "listen" and not exc.named:
            raise ConfigError(str(exc), option="listen") from exc
        raise

"""Node settings from flags, a TOML file and ``P2PKV_*`` environment variables.

Precedence: command-line flag > environment variable > TOML file > built-in default.
Every option has one canonical name (``tp``, ``pool_blocks``, ...): the flag is
``--tp``/``--pool-blocks``, the variable ``P2PKV_TP``/``P2PKV_POOL_BLOCKS`` and the TOML
key ``tp``/``pool_blocks`` (top level, or under a ``[node]`` table). The options, their
kinds, defaults and bounds are the one table's (:mod:`p2pkv.protocol.options`). A bad
value raises
:class:`~p2pkv.errors.ConfigError` that names the option as data (``option``); its
message starts with the option's flag, and the vLLM tier spells it as its own key.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pkv.errors import ConfigError
from p2pkv.identity import IdentityExtension, RunConfig, model_overrides_digest
from p2pkv.protocol.options import OPTIONS as ALL_OPTIONS
from p2pkv.protocol.options import SERVE, Option
from p2pkv.protocol.options import heartbeat_interval as ping_interval
from p2pkv.runtime.config import NodeConfig
from p2pkv.transport import CurveKeys, load_authorized_keys, validate_address

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

__all__ = ["DEFAULT_MODEL", "OPTIONS", "Option", "Settings", "load_settings", "node_config"]


def _directory(value: str) -> str:
    """The ``directory`` option past its kind: static, or a Redis URL this node can use."""
    if value == "static":
        return value
    from p2pkv.cluster.redis_urls import parse_directory_url

    try:
        parse_directory_url(value)
    except ConfigError as exc:
        raise ConfigError(f"must be static or a Redis URL (redis://HOST:PORT/DB, "
                          f"redis+cluster://..., redis+sentinel://...): {exc.detail}",
                          option="directory") from None
    return value


#: The options of ``p2pkv-node`` (its flags, TOML keys and ``P2PKV_*`` variables), from
#: the one table (:mod:`p2pkv.protocol.options`).
OPTIONS: tuple[Option, ...] = tuple(o for o in ALL_OPTIONS if SERVE in o.where)
_BY_NAME = {o.name: o for o in OPTIONS}
DEFAULT_MODEL: str = _BY_NAME["model"].default
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
                value = opt.parse(raw)
                values[opt.name] = _directory(value) if opt.name == "directory" else value
            except ConfigError as exc:
                raise ConfigError(exc.detail, option=opt.name, origin=where,
                                  mentions=exc.mentions) from None
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
    interval = ping_interval(v["heartbeat_timeout"], v["heartbeat_interval"])
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
            nixl=v["nixl"], nixl_read_timeout=v["nixl_read_timeout"],
        )
    except ConfigError as exc:
        if exc.option == "listen" and not exc.named:
            raise ConfigError(str(exc), option="listen") from exc
        raise

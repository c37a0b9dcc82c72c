"""The one table of options (p2pkv.protocol.options) at every entry point.

Every option is tried, with values its kind must refuse (nan, infinities, negatives, zero
where it means nothing, past its bound or the protocol's, wrong types), through every
entry point that takes it: a ``p2pkv-node`` flag, a ``P2PKV_*`` variable, a TOML file,
``NodeConfig``, the protocol's ``Deadlines``/``Limits`` and the vLLM tier's options. Each
is refused there, with a ConfigError that names the option as the user gave it; the
default is taken everywhere; and a name nobody takes is refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pkv import NodeConfig
from p2pkv.errors import ConfigError
from p2pkv.integrations.vllm.options import TIER_OPTIONS, load_policy_config, tier_settings
from p2pkv.protocol.codes import MAX_KEYS
from p2pkv.protocol.limits import Deadlines, Limits
from p2pkv.protocol.options import (
    MAX_SECONDS,
    NODE,
    OPTIONS,
    SERVE,
    TIER,
    Bool,
    Choice,
    Int,
    JsonObject,
    Number,
    Option,
    Text,
    TextList,
    defaults,
    option,
)
from p2pkv.settings import load_settings

#: The node options a TOML file or a variable holds as text, for the text entry points.
SERVE_OPTIONS = [o for o in OPTIONS if SERVE in o.where]
NODE_OPTIONS = [o for o in OPTIONS if NODE in o.where]
TIER_ONLY = [o for o in OPTIONS if o.where == {TIER}]


def bad_values(opt: Option) -> st.SearchStrategy[Any]:
    """Typed values ``opt``'s kind must refuse."""
    kind = opt.kind
    wrong_type = st.sampled_from([None, [1], {"a": 1}, object()])
    if isinstance(kind, Number):
        low = (st.floats(max_value=kind.least, exclude_max=kind.least_ok)
               if not math.isinf(kind.least) else st.nothing())
        return st.one_of(
            st.sampled_from([math.nan, math.inf, -math.inf, True, "5"]), wrong_type,
            low.filter(lambda x: not math.isnan(x)),
            st.floats(min_value=kind.most, exclude_min=True, allow_infinity=False),
            st.integers(min_value=int(kind.most) + 1))
    if isinstance(kind, Int):
        return st.one_of(
            st.sampled_from([True, 1.0, 1.5, math.nan, "1"]), wrong_type,
            st.integers(max_value=kind.least - 1), st.integers(min_value=kind.most + 1))
    if isinstance(kind, Bool):
        return st.one_of(st.sampled_from([0, 1, "true", None, 1.0]), wrong_type)
    if isinstance(kind, Choice):
        return st.one_of(st.text().filter(lambda t: t not in kind.choices),
                         st.sampled_from([None, 1, True]))
    if isinstance(kind, Text):
        return st.sampled_from(["", "   ", 5, None, True, ["x"]])
    if isinstance(kind, TextList):
        return st.sampled_from(["a,b", 5, None, [""], [5]])
    assert isinstance(kind, JsonObject), kind
    return st.sampled_from(["{}", [1], 5, None, {"x": math.nan}])


def bad_texts(opt: Option) -> list[str]:
    """Text (a flag's, a variable's) ``opt``'s kind must refuse."""
    kind = opt.kind
    if isinstance(kind, Number):
        out = ["nan", "inf", "-inf", "soon", f"{kind.most * 2:g}", "-1"]
        return out if kind.least_ok else [*out, "0"]
    if isinstance(kind, Int):
        return ["x", "1.5", str(kind.least - 1), str(kind.most + 1)]
    if isinstance(kind, Bool):
        return ["maybe", "2"]
    if isinstance(kind, Choice):
        return ["no-such-" + kind.choices[0]]
    if isinstance(kind, Text):
        return ["   "]
    if isinstance(kind, JsonObject):
        return ["[1]", "{", '{"x": NaN}']
    return []  # a comma-separated list takes any text


def test_every_option_has_a_kind_a_default_its_kind_takes_and_words() -> None:
    assert len({o.name for o in OPTIONS}) == len(OPTIONS)
    for opt in OPTIONS:
        assert opt.help and opt.where and opt.where <= {SERVE, NODE, TIER}, opt
        for default in (opt.default, opt.tier_default):
            if default not in (None, ()):
                assert opt.kind.check(default) == default, opt
        assert opt.kind.describe()
    # Every wait is bounded, and no limit is past the protocol's.
    for opt in OPTIONS:
        if isinstance(opt.kind, Number) and opt.kind.what.endswith("seconds"):
            assert opt.kind.most <= MAX_SECONDS, opt
    assert option("max_keys_per_request").kind == Int(1, MAX_KEYS)


@pytest.mark.parametrize("opt", SERVE_OPTIONS, ids=lambda o: o.name)
def test_a_bad_flag_variable_or_file_value_is_refused_by_its_name(opt: Option,
                                                                  tmp_path: Path) -> None:
    for text in bad_texts(opt):
        with pytest.raises(ConfigError) as flag:
            load_settings({opt.name: text}, environ={})
        assert str(flag.value).startswith(f"{opt.flag}: "), flag.value
        assert flag.value.option == opt.name
        with pytest.raises(ConfigError) as env:
            load_settings({}, environ={opt.env: text})
        assert str(env.value).startswith(f"{opt.flag}: ")
        assert str(env.value).endswith(f"(from {opt.env})"), env.value
    for value in ([math.nan, math.inf, -1.0] if isinstance(opt.kind, Number)
                  else [True] if not isinstance(opt.kind, Bool) else ["maybe"]):
        path = tmp_path / "node.toml"
        path.write_text(f"[node]\n{opt.name} = {_toml(value)}\n")
        if isinstance(opt.kind, TextList) and value is True:
            continue
        with pytest.raises(ConfigError) as toml:
            load_settings({}, config_file=str(path), environ={})
        assert str(toml.value).endswith(f"(from {path}:{opt.name})"), toml.value
    # The default is what an entry point that is not given the option holds.
    assert load_settings({}, environ={})[opt.name] == opt.default


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_node_config_refuses_what_the_table_refuses_by_its_field_name(data: Any) -> None:
    opt = data.draw(st.sampled_from(NODE_OPTIONS))
    value = data.draw(bad_values(opt))
    field = "key_hash_seed" if opt.name == "key_seed" else opt.name
    with pytest.raises(ConfigError) as refused:
        NodeConfig(**{field: value})
    assert str(refused.value).startswith(field), refused.value


def test_node_config_takes_its_defaults_from_the_table() -> None:
    config = NodeConfig()
    for name, default in defaults(NODE).items():
        field = "key_hash_seed" if name == "key_seed" else name
        if default is not None:
            assert getattr(config, field) == default, name
    assert config.heartbeat_interval == 1.0  # the rule's: min(1, heartbeat_timeout / 4)


def _another(opt: Option) -> Any:
    """A good value of ``opt`` other than its default."""
    kind, default = opt.kind, opt.default
    if isinstance(kind, Bool):
        return not default
    if isinstance(kind, Choice):
        return next(c for c in kind.choices if c != default)
    if isinstance(kind, Number):
        return default / 2
    return default + 1


def test_every_option_serve_takes_for_the_node_reaches_its_node_config() -> None:
    from p2pkv.settings import node_config

    skipped = {"listen", "key_seed", "heartbeat_interval", "data_port"}
    for opt in SERVE_OPTIONS:
        if NODE not in opt.where or opt.name in skipped or opt.name.startswith("curve"):
            continue
        value = _another(opt)
        config = node_config(load_settings({opt.name: str(value).lower()
                                            if isinstance(value, bool) else str(value)},
                                           environ={}))
        assert getattr(config, opt.name) == value, opt.name


@pytest.mark.parametrize(("make", "named"), [
    (lambda: Deadlines(handshake=math.nan), "deadlines.handshake"),
    (lambda: Deadlines(fetch_idle=math.inf), "deadlines.fetch_idle"),
    (lambda: Deadlines(heartbeat_interval=5.0), "deadlines.heartbeat_interval"),
    (lambda: Limits(max_keys=MAX_KEYS + 1), "limits.max_keys"),
    (lambda: Limits(max_in_flight=0), "limits.max_in_flight"),
])
def test_the_protocols_deadlines_and_limits_check_by_the_table(make: Any, named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named}"):
        make()
    assert Deadlines().handshake == option("handshake_timeout").default
    assert Limits().max_keys == option("max_keys_per_request").default


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_vllm_tier_refuses_what_the_table_refuses_in_its_words(data: Any) -> None:
    names = [n for n in TIER_OPTIONS if n not in ("peers", "curve_secret_key",
                                                   "curve_authorized", "curve_server_key")]
    name = data.draw(st.sampled_from(names))
    opt = option(name)
    value = data.draw(bad_values(opt))
    if value is None or (SERVE in opt.where and isinstance(value, str)):
        return  # null is "not given"; a node option's text is read as a flag's
    with pytest.raises(ConfigError) as refused:
        tier_settings({name: value})
        load_policy_config({name: value})
    assert str(refused.value).startswith(f"P2PKVTier: {name}"), refused.value


def test_the_vllm_tier_takes_the_tables_defaults_and_names() -> None:
    settings_, peers, waits = tier_settings({})
    assert settings_["lookup_timeout"] == option("lookup_timeout").tier_default == 1.0
    assert settings_["fetch_timeout"] == option("fetch_timeout").tier_default == 10.0
    assert settings_["handshake_timeout"] == option("handshake_timeout").default
    assert peers == ()
    assert waits.pending_wait == option("pending_wait").default
    assert load_policy_config({}).min_speedup == option("load_min_speedup").default
    assert {o.name for o in TIER_ONLY} <= set(TIER_OPTIONS)
    with pytest.raises(ConfigError, match="unknown option"):
        tier_settings({"handshake_timout": 5})


def test_unknown_names_are_refused_where_they_are_given(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text("[node]\nhandshake_timout = 5\n")
    with pytest.raises(ConfigError, match="unknown option 'handshake_timout'"):
        load_settings({}, config_file=str(path), environ={})
    with pytest.raises(TypeError):
        NodeConfig(handshake_timout=5)  # type: ignore[call-arg]
    with pytest.raises(KeyError):
        option("handshake_timout")


def test_the_docs_list_every_option_of_the_tier_and_of_node_config() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    tier = doc[doc.index("## vLLM tier"):doc.index("### The load policy")]
    listed = {name.strip("` ") for line in tier.splitlines() if line.startswith("| `")
              for name in line.split("|")[1].split(",")}
    assert set(TIER_OPTIONS) <= listed, set(TIER_OPTIONS) - listed
    cells = [line.replace("\\|", "/").split("|") for line in doc.splitlines()
             if line.startswith("| `")]
    rows = {c[1].strip(" `"): c[3].strip(" `") for c in cells if len(c) == 6}
    for opt in OPTIONS:
        if opt.where == {NODE}:
            assert rows[opt.name] == str(opt.default).lower(), opt.name


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0.0, MAX_SECONDS * 2, "5"])
def test_a_clusters_waits_follow_the_same_rule(value: Any) -> None:
    from p2pkv.cluster import ClusterConfig

    for name in ("ttl", "redis_timeout", "refusal_backoff", "fetch_timeout"):
        over = isinstance(value, float) and math.isfinite(value) and value > MAX_SECONDS
        with pytest.raises(ConfigError, match=f"^{name} must be at most" if over else
                           f"^{name} must be a positive number of seconds"):
            ClusterConfig(**{name: value})
    assert ClusterConfig().ttl == option("directory_ttl").default
    assert ClusterConfig().refusal_backoff == option("refused_retry_interval").default

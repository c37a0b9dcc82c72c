"""``serve --fill N`` and ``fetch ADDR --fill-keys N`` (protocol/SPEC.md appendix A).

Real processes on 127.0.0.1: a serving CLI process, the fetching CLI process, and where
content must be wrong on purpose, an in-process node that the CLI fetches from. The
content a ``serve --fill`` process holds is checked against ``vectors/fill.json``, which
is computed independently of ``p2pkv.fill``.
"""

from __future__ import annotations

import hashlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clitools import Serve, clean_env, config_error, run

from p2pkv.bench.ports import free_port
from p2pkv.fill import fill_block, fill_keys
from p2pkv.node import Node, NodeConfig
from p2pkv.settings import load_settings

pytestmark = pytest.mark.timeout(180)

VECTORS = Path(__file__).resolve().parent.parent / "protocol" / "vectors"
SEED_BLOCK = 589824  # the CLI's default geometry: the seed model, V2


@pytest.fixture
def served() -> Iterator[Any]:
    """``served(*args)``: a ``serve --json`` process; returns (process, listening event)."""
    procs: list[Serve] = []

    def start(*args: str, env: dict[str, str] | None = None) -> tuple[Serve, dict[str, Any]]:
        proc = Serve("--json", "--listen", f"tcp://127.0.0.1:{free_port()}", *args, env=env)
        procs.append(proc)
        event = proc.event()
        assert event["event"] == "listening", event
        return proc, event

    yield start
    for proc in procs:
        if proc.proc.poll() is None:
            proc.stop(signal.SIGTERM)
        proc.kill()


def fetch(address: str, n: int, *args: str) -> tuple[int, dict[str, Any]]:
    r = run("fetch", address, "--fill-keys", str(n), "--json", "--handshake-timeout", "5",
            *args)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout)


def test_fetch_verifies_every_block_of_a_filled_node(served: Any) -> None:
    _, ready = served("--fill", "6")
    assert ready["fill"] == 6
    code, out = fetch(ready["address"], 6)
    assert code == 0, out
    assert out["verdict"] == "verified" and out["blocks"] == out["verified"] == 6
    assert out["bytes"] == 6 * SEED_BLOCK and out["problems"] == []
    assert out["gbps"] > 0 and out["seconds"] > 0
    text = run("fetch", ready["address"], "--fill-keys", "6")
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"VERIFIED 6/6 blocks from {ready['address']}: "
                                  f"{6 * SEED_BLOCK} bytes in "), text.stdout
    assert "GB/s" in text.stdout


def test_filled_content_matches_the_independent_vectors(served: Any) -> None:
    """An in-process node fetches from ``serve --fill`` and compares with fill.json."""
    vector = next(v for v in json.loads((VECTORS / "fill.json").read_text())["vectors"]
                  if v["name"] == "seed_geometry_589824_bytes")
    _, ready = served("--fill", str(vector["count"]))
    settings = load_settings({}, environ={})
    layout = settings.layout()
    assert layout.bytes_per_block == vector["bytes_per_block"]
    keys = [bytes.fromhex(b["key"]) for b in vector["blocks"]]
    with Node(settings.run_config(layout), layout, pool_blocks=len(keys),
              config=NodeConfig()) as node:
        result = node.connect(ready["address"]).fetch(keys, timeout=60)
        assert result.stored == keys
        for key, want in zip(keys, vector["blocks"], strict=True):
            data = node.get(key)
            assert data is not None
            assert hashlib.sha256(data).hexdigest() == want["sha256"]


def test_missing_keys_exit_5_and_name_each_block(served: Any) -> None:
    _, ready = served("--fill", "3")
    code, out = fetch(ready["address"], 5)
    assert code == 5, out
    assert out["verdict"] == "mismatch" and out["verified"] == 3
    assert [(p["index"], p["problem"]) for p in out["problems"]] == [(3, "missing"),
                                                                      (4, "missing")]


def test_wrong_bytes_exit_5_and_name_the_byte() -> None:
    """The server holds the fill keys, but block 1 has one wrong byte."""
    settings = load_settings({}, environ={})
    layout = settings.layout()
    rc = settings.run_config(layout)
    keys = fill_keys(3, seed=0, tokens_per_hash=rc.tokens_per_hash)
    with Node(rc, layout, pool_blocks=4, config=NodeConfig()) as server:
        for i, key in enumerate(keys):
            data = bytearray(fill_block(key, layout.bytes_per_block))
            if i == 1:
                data[1000] ^= 0xFF
            server.put(key, bytes(data))
        code, out = fetch(server.address, 3)
        assert code == 5, out
        assert [(p["index"], p["problem"]) for p in out["problems"]] == [(1, "corrupt")]
        assert "byte 1000" in out["problems"][0]["detail"]
        text = run("fetch", server.address, "--fill-keys", "3")
        assert text.returncode == 5
        assert text.stdout.startswith("MISMATCH 2/3 blocks"), text.stdout
        assert f"block 1 ({keys[1].hex()}): corrupt byte 1000" in text.stdout


def test_refused_and_unreachable(served: Any) -> None:
    _, ready = served("--fill", "2")
    code, out = fetch(ready["address"], 2, "--key-seed", "7")
    assert code == 3, out
    assert out["verdict"] == "refused"
    assert [r["field"] for r in out["reasons"]] == ["key_hash.seed"]
    code, out = fetch(f"tcp://127.0.0.1:{free_port()}", 2, "--handshake-timeout", "1")
    assert code == 4, out
    assert out["verdict"] == "unreachable"


def test_fill_from_environment_and_toml(served: Any, tmp_path: Path) -> None:
    _, ready = served(env=clean_env(P2PKV_FILL="3"))
    assert ready["fill"] == 3
    assert fetch(ready["address"], 3)[0] == 0
    toml = tmp_path / "node.toml"
    toml.write_text("[node]\nfill = 2\npool_blocks = 8\n")
    _, ready = served("--config", str(toml))
    assert ready["fill"] == 2


def test_bad_fill_values_are_configuration_errors() -> None:
    line = config_error(run("serve", "--fill", "300", "--pool-blocks", "256"))
    assert line.startswith("p2pkv-node: error: --fill: 300 blocks do not fit a pool of 256")
    assert "--fill:" in config_error(run("serve", "--fill", "-1"))
    line = config_error(run("fetch", "tcp://127.0.0.1:1", "--fill-keys", "0"))
    assert line.startswith("p2pkv-node: error: --fill-keys: must be in [1, ")
    assert "ADDRESS" in config_error(run("fetch", "nowhere", "--fill-keys", "2"))

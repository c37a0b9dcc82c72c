"""An adapter is known by its content: the digest of its files, and block keys salted with
it (p2pkv.identity.adapter), plus the modeling-code digest of trust_remote_code
checkpoints. Real files on disk; the engine-side tests are in test_vllm.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from p2pkv.identity.adapter import (
    AdapterError,
    adapter_identity,
    adapter_key,
    adapter_name_key,
)
from p2pkv.identity.checkpoint import modeling_code_digest

CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16,
          "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"]}
#: A vLLM offload key: a 32-byte block hash and the 4-byte group index.
KEY = bytes(range(32)) + (1).to_bytes(4, "big")


def adapter(root: Path, weights: bytes = b"\x01" * 4096,
            config: dict[str, object] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps(config or CONFIG))
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "digests.json"


def test_equal_files_at_two_paths_have_one_digest(tmp_path: Path, cache: Path) -> None:
    a = adapter_identity(adapter(tmp_path / "host-a" / "ad"), cache=cache)
    b = adapter_identity(adapter(tmp_path / "host-b" / "ad"), cache=cache)
    assert a.digest == b.digest and len(a.digest) == 16
    assert [f.name for f in a.files] == ["adapter_config.json", "adapter_model.safetensors"]
    assert a.total_bytes == b.total_bytes


def test_one_byte_of_the_weights_or_the_config_changes_the_digest(tmp_path: Path,
                                                                  cache: Path) -> None:
    base = adapter_identity(adapter(tmp_path / "v1"), cache=cache).digest
    weights = bytearray(b"\x01" * 4096)
    weights[1000] ^= 1
    other = adapter_identity(adapter(tmp_path / "v2", bytes(weights)), cache=cache).digest
    alpha = adapter_identity(adapter(tmp_path / "v3", config={**CONFIG, "lora_alpha": 32}),
                             cache=cache).digest
    assert len({base, other, alpha}) == 3


def test_extra_tensors_count_and_other_files_do_not(tmp_path: Path, cache: Path) -> None:
    root = adapter(tmp_path / "ad")
    before = adapter_identity(root, cache=cache).digest
    (root / "README.md").write_text("notes")
    assert adapter_identity(root, cache=cache).digest == before
    (root / "new_embeddings.safetensors").write_bytes(b"\x02" * 64)
    assert adapter_identity(root, cache=cache).digest != before


def test_digest_cache_is_reused_and_never_stale(tmp_path: Path, cache: Path) -> None:
    root = adapter(tmp_path / "ad")
    first = adapter_identity(root, cache=cache)
    assert {f.source for f in first.files} == {"hashed"}
    again = adapter_identity(root, cache=cache)
    assert {f.source for f in again.files} == {"cache"} and again.digest == first.digest
    # Rewritten in place, same size, its mtime put back (a copy that keeps times): the
    # ctime still changes, and the digest is computed again.
    path = root / "adapter_model.safetensors"
    old = path.stat()
    path.write_bytes(b"\x03" * 4096)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    rewritten = adapter_identity(root, cache=cache)
    assert rewritten.digest != first.digest
    assert "hashed" in {f.source for f in rewritten.files}


@pytest.mark.parametrize("case", ["missing", "no config", "no weights", "a file"])
def test_an_adapter_that_cannot_be_hashed_is_an_error(tmp_path: Path, cache: Path,
                                                      case: str) -> None:
    root = tmp_path / "ad"
    if case == "no config":
        adapter(root)
        (root / "adapter_config.json").unlink()
    elif case == "no weights":
        adapter(root)
        (root / "adapter_model.safetensors").unlink()
    elif case == "a file":
        root.write_text("not a directory")
    with pytest.raises(AdapterError) as err:
        adapter_identity(root, cache=cache)
    assert str(root) in str(err.value)


def test_salted_keys_keep_length_and_group_and_depend_on_content() -> None:
    salted = adapter_key("0123456789abcdef", KEY)
    assert len(salted) == len(KEY) and salted[-4:] == KEY[-4:] and salted != KEY
    assert adapter_key("0123456789abcdef", KEY) == salted  # deterministic
    assert adapter_key("fedcba9876543210", KEY) != salted
    other_block = bytes(32) + KEY[-4:]
    assert adapter_key("0123456789abcdef", other_block) != salted
    # The name-and-path key is another key space: never equal to a content key.
    name = adapter_name_key("ad", "/adapters/ad", KEY)
    assert name not in (salted, KEY) and len(name) == len(KEY)
    assert adapter_name_key("ad", "/adapters/ad2", KEY) != name
    # Keys of any hash length: an 8-byte hash and a 64-byte one.
    for size in (8, 64):
        key = b"\x07" * size + KEY[-4:]
        assert len(adapter_key("0123456789abcdef", key)) == len(key)
    with pytest.raises(ValueError, match="no hash"):
        adapter_key("0123456789abcdef", KEY[-4:])


def test_modeling_code_is_hashed_file_by_file(tmp_path: Path, cache: Path) -> None:
    root = tmp_path / "model"
    root.mkdir()
    assert modeling_code_digest(root, cache=cache) is None
    (root / "modeling_custom.py").write_text("def attention(): return 1\n")
    first = modeling_code_digest(root, cache=cache)
    assert first is not None and len(first) == 16
    (root / "modeling_custom.py").write_text("def attention(): return 2\n")
    assert modeling_code_digest(root, cache=cache) not in (None, first)
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.py").write_text("ignored")
    second = modeling_code_digest(root, cache=cache)
    (root / "sub").mkdir()
    (root / "sub" / "layers.py").write_text("x = 1\n")
    assert modeling_code_digest(root, cache=cache) != second


def test_the_cost_benchmark_measures_each_way(tmp_path: Path) -> None:
    """``python -m p2pkv.bench.adapter``: one row per size, the digest cache read back."""
    import subprocess
    import sys

    rows = tmp_path / "rows.json"
    out = subprocess.run([sys.executable, "-m", "p2pkv.bench.adapter", "--mb", "0.5,1",
                          "--dir", str(tmp_path), "--json", str(rows)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(rows.read_text())
    assert [round(r["mb"], 1) for r in data] == [0.5, 1.0]
    assert all(r["first_request_s"] > 0 and r["digest_cache_s"] > 0 for r in data)
    assert "first request" in out.stdout
    assert list(tmp_path.iterdir()) == [rows]  # the adapters are removed
    bad = subprocess.run([sys.executable, "-m", "p2pkv.bench.adapter", "--mb", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--mb must be numbers" in bad.stderr

"""The identity a checkpoint on disk gives (``p2pkv.identity.checkpoint``): real files in a
temporary directory, a real digest cache, a Hugging Face cache layout made on disk, and
the ``--model-path`` option of the launcher against a live node."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from clitools import Serve

from p2pkv.identity.checkpoint import (
    CheckpointError,
    FileDigest,
    checkpoint_identity,
    config_digest,
    weights_digest,
)

VECTORS = json.loads((Path(__file__).resolve().parent.parent / "protocol" / "vectors"
                      / "extension.json").read_text(encoding="utf-8"))
CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "hidden_size": 256, "torch_dtype": "float32",
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}


def checkpoint(root: Path, weights: bytes, *, name: str = "model.safetensors",
               config: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(weights)
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    return root


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "digests.json"


@pytest.mark.parametrize("case", VECTORS["model_weights"],
                         ids=[c["name"] for c in VECTORS["model_weights"]])
def test_weights_manifest_vectors(case: dict[str, Any]) -> None:
    files = [FileDigest(f["name"], f["size"], f["sha256"], "hashed") for f in case["files"]]
    assert weights_digest(files) == case["model_weights"]


@pytest.mark.parametrize("case", VECTORS["model_config"],
                         ids=[c["name"] for c in VECTORS["model_config"]])
def test_model_config_vectors(case: dict[str, Any]) -> None:
    assert config_digest(case["config"]) == case["model_config"]


def test_same_names_shapes_and_sizes_other_bytes_differ(tmp_path: Path, cache: Path) -> None:
    a = checkpoint(tmp_path / "a", bytes(range(256)) * 64)
    b = checkpoint(tmp_path / "b", bytes(reversed(range(256))) * 64)
    ia, ib = checkpoint_identity(a, cache=cache), checkpoint_identity(b, cache=cache)
    assert ia.total_bytes == ib.total_bytes
    assert ia.model_weights != ib.model_weights
    assert ia.model_config == ib.model_config
    manifest = [FileDigest("model.safetensors", 16384,
                           hashlib.sha256(bytes(range(256)) * 64).hexdigest(), "hashed")]
    assert ia.model_weights == weights_digest(manifest)
    assert [f.source for f in ia.files] == ["hashed"]


def test_digest_cache_is_reused_and_never_stale(tmp_path: Path, cache: Path) -> None:
    path = checkpoint(tmp_path / "m", b"x" * 4096)
    first = checkpoint_identity(path, cache=cache)
    again = checkpoint_identity(path, cache=cache)
    assert again.model_weights == first.model_weights
    assert [f.source for f in again.files] == ["cache"]
    # Rewritten in place with the same size and its old mtime put back: the ctime moves,
    # so the cached digest is not used for the new bytes.
    st = (path / "model.safetensors").stat()
    (path / "model.safetensors").write_bytes(b"y" * 4096)
    os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = checkpoint_identity(path, cache=cache)
    assert [f.source for f in changed.files] == ["hashed"]
    assert changed.model_weights != first.model_weights


def test_a_corrupt_cache_file_costs_a_rehash(tmp_path: Path, cache: Path) -> None:
    path = checkpoint(tmp_path / "m", b"z" * 1000)
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    ident = checkpoint_identity(path, cache=cache)
    assert [f.source for f in ident.files] == ["hashed"]
    assert json.loads(cache.read_text())  # rewritten, readable again


def test_hugging_face_blob_names_are_read_instead_of_the_bytes(tmp_path: Path,
                                                              cache: Path) -> None:
    """In a hub cache a snapshot file links to ``blobs/<sha256>``: the name is the digest
    (shown here with a blob whose name is not its content's hash: the name is used), and
    the snapshot directory gives the revision."""
    repo = tmp_path / "hub" / "models--org--m"
    name = "b" * 64
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / name).write_bytes(b"weights")
    commit = "c" * 40
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(Path("../../blobs") / name)
    (snap / "config.json").write_text(json.dumps(CONFIG))
    ident = checkpoint_identity(snap, cache=cache)
    assert [(f.sha256, f.source) for f in ident.files] == [(name, "hf-blob")]
    assert ident.revision == commit
    assert "Hugging Face" in ident.sources["model_weights"]


def test_weight_file_choice_follows_the_engine(tmp_path: Path, cache: Path) -> None:
    path = checkpoint(tmp_path / "m", b"s" * 10)
    (path / "pytorch_model.bin").write_bytes(b"p" * 10)
    (path / ".hidden.safetensors").write_bytes(b"h")
    names = [f.name for f in checkpoint_identity(path, cache=cache).files]
    assert names == ["model.safetensors"]  # safetensors first, as vLLM loads them
    (path / "model.safetensors").unlink()
    assert [f.name for f in checkpoint_identity(path, cache=cache).files] == \
        ["pytorch_model.bin"]
    gguf = tmp_path / "one.gguf"
    gguf.write_bytes(b"g" * 5)
    single = checkpoint_identity(gguf, cache=cache)
    assert [f.name for f in single.files] == ["one.gguf"] and single.model_config is None


def test_config_metadata_does_not_count_but_rope_does(tmp_path: Path, cache: Path) -> None:
    a = checkpoint(tmp_path / "a", b"w", config={**CONFIG, "_name_or_path": "/x",
                                                 "transformers_version": "4.0"})
    b = checkpoint(tmp_path / "b", b"w", config={**CONFIG, "_name_or_path": "/y",
                                                 "transformers_version": "5.0"})
    c = checkpoint(tmp_path / "c", b"w", config={
        **CONFIG, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})
    ia, ib, ic = (checkpoint_identity(p, cache=cache) for p in (a, b, c))
    assert ia.model_config == ib.model_config != ic.model_config
    assert ia.model_weights == ib.model_weights == ic.model_weights


@pytest.mark.parametrize("case", ["missing", "empty", "dangling", "bad config"])
def test_unusable_checkpoints_are_errors_never_an_identity(tmp_path: Path, cache: Path,
                                                           case: str) -> None:
    path = tmp_path / "m"
    if case != "missing":
        path.mkdir()
    if case == "empty":
        (path / "config.json").write_text("{}")
    if case == "dangling":
        (path / "model.safetensors").symlink_to(tmp_path / "gone")
    if case == "bad config":
        (path / "model.safetensors").write_bytes(b"w")
        (path / "config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError) as excinfo:
        checkpoint_identity(path, cache=cache)
    assert str(path) in str(excinfo.value)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pkv.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_derives_weights_and_refuses_other_weights(tmp_path: Path) -> None:
    """``--model-path`` on both sides, nothing declared: equal checkpoints meet, another
    checkpoint of the same shapes under the same model name is refused, and the
    refusal and ``fingerprint --json`` say where the local digest came from."""
    a = checkpoint(tmp_path / "a", b"\x01" * 8192)
    b = checkpoint(tmp_path / "b", b"\x02" * 8192)
    env = {**os.environ, "P2PKV_CACHE_DIR": str(tmp_path / "cache")}
    out = run_cli("fingerprint", "--model", "org/m", "--model-path", str(a), "--json", env=env)
    assert out.returncode == 0, out.stderr
    ident = json.loads(out.stdout)
    assert ident["extension"]["model_weights"] == checkpoint_identity(
        a, cache=tmp_path / "c2.json").model_weights
    assert "SHA-256 of 1 weight file" in ident["identity_sources"]["model_weights"]
    assert ident["run_config"]["model_name"] == "org/m"
    server = Serve("--json", "--model", "org/m", "--model-path", str(a), "--pool-blocks", "4",
                   env=env)
    try:
        info = server.event()
        assert info["extension"]["model_weights"] == ident["extension"]["model_weights"]
        assert "model_weights" in info["identity_sources"]
        same = run_cli("probe", info["address"], "--model", "org/m", "--model-path", str(a),
                       env=env)
        other = run_cli("probe", info["address"], "--model", "org/m", "--model-path", str(b),
                        "--json", env=env)
    finally:
        server.kill()
    assert same.returncode == 0, same.stdout + same.stderr
    assert "model_weights" in same.stdout
    assert other.returncode == 3, other.stdout + other.stderr
    verdict = json.loads(other.stdout)
    assert [r["field"] for r in verdict["reasons"]] == ["ext.model_weights"]
    assert "different weights" in verdict["reasons"][0]["meaning"]
    assert str(b) in verdict["local_identity_sources"]["model_weights"]

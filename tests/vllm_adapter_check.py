"""Checks of the tier's per-request adapter identity, run with the vLLM environment's
Python (test_vllm.py::test_request_adapters_are_known_by_content runs it).

The requests are vLLM's own ``LoRARequest`` objects, handed over as p2pkv's connector
hands them (``begin(req_id, lora_request)``); the RoPE cases are model configs with the
attributes vLLM's ``ModelConfig`` has. Prints one JSON
line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from loraadapters import write_adapter
from vllm.lora.request import LoRARequest

from p2pkv.identity.adapter import adapter_identity, adapter_key
from p2pkv.integrations.vllm.adapters import (
    ADAPTER_UNKNOWN,
    ADAPTER_UNREADABLE,
    RequestAdapters,
)
from p2pkv.integrations.vllm.identity import _rope_of_run, derive_engine_identity

KEY = bytes(range(32)) + (0).to_bytes(4, "big")


def check(name: str, ok: bool, **detail: Any) -> None:
    print(json.dumps({"check": name, "ok": bool(ok), **detail}), flush=True)
    if not ok:
        sys.exit(1)


def settled(adapters: RequestAdapters, req_id: str) -> None:
    deadline = time.monotonic() + 30
    while adapters.pending(req_id) and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> int:
    home = Path(tempfile.mkdtemp(prefix="p2pkv-adapters-"))
    os.chdir(home)
    write_adapter(home / "adapters" / "ad", seed=1)
    cache = home / "cache.json"
    counted: list[tuple[str, int]] = []

    off = RequestAdapters(lora_enabled=False, cache=cache)
    check("lora off: vLLM's keys", off.keys("r0", [KEY]).keys == [KEY])

    on = RequestAdapters(lora_enabled=True, cache=cache,
                         count=lambda reason, n: counted.append((reason, n)))
    on.begin("base", None)
    check("base request: vLLM's keys", on.keys("base", [KEY]).keys == [KEY])

    on.begin("lora", LoRARequest("ad", 1, "adapters/ad"))  # relative, as vLLM resolves
    settled(on, "lora")
    digest = adapter_identity(home / "adapters" / "ad", cache=cache).digest
    shared = on.keys("lora", [KEY])
    check("adapter: salted by its content", shared.keys == [adapter_key(digest, KEY)],
          adapter=shared.adapter)
    check("adapter: a name key per key", shared.name_keys is not None
          and len(shared.name_keys) == 1 and shared.name_keys[0] not in (KEY, *shared.keys))

    state = on.state("lora")
    on.finished("lora")
    check("finished: a state taken before still names the adapter",
          on.shared(state, [KEY]).keys == shared.keys
          and on.keys("lora", [KEY]).reason == ADAPTER_UNKNOWN)

    # Never handed over (a tier under vLLM's plain OffloadingConnector).
    unknown = on.keys("nowhere", [KEY, KEY])
    check("adapter not told: not shared", unknown.keys is None
          and unknown.reason == ADAPTER_UNKNOWN)
    on.count(str(unknown.reason), 2)
    check("counted by reason", counted == [(ADAPTER_UNKNOWN, 2)]
          and on.describe()["unshared_blocks"] == {ADAPTER_UNKNOWN: 2})

    on.begin("missing", LoRARequest("gone", 2, str(home / "no-such-adapter")))
    settled(on, "missing")
    missing = on.keys("missing", [KEY])
    check("unreadable adapter: not shared", missing.keys is None
          and missing.reason == ADAPTER_UNREADABLE)

    # A rolling update on this host: the files change under the same name and path.
    write_adapter(home / "adapters" / "ad", seed=2)
    on.begin("updated", LoRARequest("ad", 1, "adapters/ad"))
    settled(on, "updated")
    updated = on.keys("updated", [KEY]).keys
    new_digest = adapter_identity(home / "adapters" / "ad", cache=cache).digest
    check("files changed: the new content's keys", new_digest != digest
          and updated == [adapter_key(new_digest, KEY)])

    def model(rope: dict[str, Any] | None, max_len: int) -> Any:
        hf = SimpleNamespace(rope_parameters=rope)
        return SimpleNamespace(hf_config=hf, hf_text_config=hf, max_model_len=max_len)

    longrope = {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                "long_factor": [1.0], "short_factor": [1.0]}
    check("longrope: the factors the run chose",
          _rope_of_run(model(longrope, 8192)) == {"rope_type": "longrope",
                                                   "long_factors": True}
          and _rope_of_run(model(longrope, 2048)) == {"rope_type": "longrope",
                                                       "long_factors": False}
          and _rope_of_run(model(longrope, 3000)) == _rope_of_run(model(longrope, 2048)))
    check("static RoPE types stay out",
          all(_rope_of_run(model(r, 8192)) is None for r in (
              None, {"rope_type": "default", "rope_theta": 1e5},
              {"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0},
              {"rope_type": "llama3", "factor": 8.0}, {"type": "linear", "factor": 2.0})))
    check("per-attention-type RoPE (transformers 5)",
          _rope_of_run(model({"full_attention": longrope,
                              "sliding_attention": {"rope_type": "default"}}, 8192))
          == {"rope_type": "longrope", "long_factors": True})
    on.shutdown()
    if len(sys.argv) > 1:
        remote_code(Path(sys.argv[1]), home)
    return 0


def remote_code(model_dir: Path, home: Path) -> None:
    """Under trust_remote_code the checkpoint's *.py files enter model_overrides."""
    from vllm.config import ModelConfig, VllmConfig

    root = home / "remote-code-model"
    root.mkdir()
    (root / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    (root / "model.safetensors").symlink_to(model_dir / "model.safetensors")

    def overrides(trust: bool) -> Any:
        config = VllmConfig(model_config=ModelConfig(
            model=str(root), skip_tokenizer_init=True, dtype="float32",
            trust_remote_code=trust))
        return derive_engine_identity(None, config, {})

    plain = overrides(False)
    (root / "modeling_custom.py").write_text("ATTENTION = 'v1'\n")
    before = overrides(False)
    trusted = overrides(True)
    (root / "modeling_custom.py").write_text("ATTENTION = 'v2'\n")
    edited = overrides(True)
    check("remote code: hashed only when trusted", plain.model_overrides
          == before.model_overrides and trusted.model_overrides != before.model_overrides
          and "remote_code" in trusted.overrides_canonical,
          canonical=trusted.overrides_canonical)
    check("remote code: an edit changes the identity",
          edited.model_overrides not in (trusted.model_overrides, before.model_overrides))


if __name__ == "__main__":
    sys.exit(main())

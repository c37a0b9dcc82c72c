"""Where the tests that start real vLLM engines find them: the vLLM environment, the
model directory, and whether their absence is a failure (``make test`` sets
``P2PKV_REQUIRE_VLLM=1``) or a skip."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = Path(os.environ.get("P2PKV_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MODELS = Path(os.environ.get("P2PKV_MODELS_DIR", ROOT / ".models"))
REQUIRED = os.environ.get("P2PKV_REQUIRE_VLLM") == "1"


def skip_without_vllm() -> None:
    """Skip the calling test module when there is no vLLM environment, unless required."""
    if not VLLM_PY.exists() and not REQUIRED:
        pytest.skip(f"no vLLM environment at {VLLM_PY} (make vllm-env creates it)",
                    allow_module_level=True)


#: vLLM 0.33's Python over the compiled ops of .venv-vllm's vLLM 0.32 (``make vllm033``;
#: tools/vllm_overlay.py says what that covers and what it does not).
VLLM033 = Path(os.environ.get("P2PKV_VLLM033_DIR", ROOT / ".vllm033"))
#: The vLLM releases the API-level checks run on.
VERSIONS = ("0.32", "0.33")


def vllm_env(version: str) -> dict[str, str]:
    """What to add to the environment of .venv-vllm's Python to run vLLM ``version``."""
    if version == "0.32":
        return {}
    if version != "0.33":
        raise ValueError(f"no vLLM {version} here; choose from {', '.join(VERSIONS)}")
    if not (VLLM033 / ".complete").exists():
        message = f"no vLLM 0.33 overlay at {VLLM033} (make vllm033 builds it)"
        pytest.fail(message) if REQUIRED else pytest.skip(message)
    path = os.pathsep.join(p for p in (str(VLLM033), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "VLLM_TARGET_DEVICE": "cpu"}


def smollm2() -> Path:
    """The real chat model's directory (``make real-model`` builds it)."""
    path = MODELS / "smollm2"
    if not (path / ".complete").exists():
        message = f"no model at {path}: make real-model builds it"
        pytest.fail(message) if REQUIRED else pytest.skip(message)
    return path


def serve(cluster: Any) -> Iterator[Any]:
    """Run a :class:`~p2pkv.bench.serving.cluster.ServingCluster` for a module's tests
    (``yield from`` it in a fixture), then check that none of its processes is left, and
    nothing its engines made in /dev/shm (a killed engine's included)."""
    from p2pkv.bench.serving.leftovers import in_use, vllm_shm

    before = vllm_shm()
    with cluster:
        yield cluster
    for pid in cluster.pids():
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert vllm_shm() - before - in_use() == set()

"""Where the tests that start real vLLM engines find them: the vLLM environment, the
model directory, and whether their absence is a failure (``make test`` sets
``P2PKV_REQUIRE_VLLM=1``) or a skip."""

from __future__ import annotations

import os
from pathlib import Path

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

"""What a user of the package touches first: star-imports, and threads they can tell apart.

- ``from PKG import *`` works for every package whose ``__all__`` is public: each name
  listed exists (the vLLM integration needs vLLM and is checked in ``.venv-vllm``).
- The worker helper's threads carry names, like every other thread p2pkv starts, so a
  thread dump or ``py-spy`` says whose thread it is.
"""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path

import pytest

from p2pkv.workers import JsonLineProcess

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(
    ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "p2pkv").rglob("__init__.py")
    if "vllm" not in p.parent.relative_to(ROOT).parts)


@pytest.mark.parametrize("package", PACKAGES)
def test_star_import_of_every_package(package: str) -> None:
    module = importlib.import_module(package)
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert missing == [], f"{package}.__all__ names what it does not define: {missing}"
    namespace: dict[str, object] = {}
    exec(f"from {package} import *", namespace)


def test_worker_threads_have_names() -> None:
    before = set(threading.enumerate())
    child = JsonLineProcess([sys.executable, "-c", "import sys; sys.stdin.read()"])
    try:
        started = [t.name for t in set(threading.enumerate()) - before]
        assert len(started) == 2, started
        assert all(name.startswith("worker-") for name in started), started
    finally:
        child.kill()

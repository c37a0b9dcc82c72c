"""The README's embedding example is real code: run it exactly as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def embedding_example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- embedding-example -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README lost its embedding example block"
    return match.group(1)


def test_readme_embedding_example_is_short() -> None:
    lines = [ln for ln in embedding_example().splitlines() if ln.strip()]
    assert len(lines) <= 22


def test_readme_embedding_example_runs() -> None:
    proc = subprocess.run([sys.executable, "-c", embedding_example()], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

"""``tools/gpu_check.sh`` runs here as what it is without CUDA: a dry run.

The script exists for a GPU machine that sessions see rarely; these tests keep it working
in between: every step runs, the fetch between two nodes verifies its bytes, the report
has the shape the device's ``$OUT`` takes back (at most 8 files, plain names), and a
budget that is spent still ends in a report that says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"
CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.timeout(120)


def run_check(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    full = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
            "GPU_CHECK_INSTALL": "never", "GPU_CHECK_SITE": str(tmp_path / "site"),
            "GPU_CHECK_FETCH_MIB": "16", **env}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=110)
    return proc, out


def report(out: Path) -> dict[str, Any]:
    data = json.loads((out / "gpu_check.json").read_text())
    assert isinstance(data, dict)
    return data


def test_dry_run_runs_every_step_and_verifies_the_fetch(tmp_path: Path) -> None:
    proc, out = run_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = report(out)
    assert data["ok"] is True and data["problems"] == []
    assert data["cuda"] is CUDA and data["dry_run"] is not CUDA
    assert [s["name"] for s in data["steps"]] == ["deps", "env", "pytest", "fetch"]
    assert all(s["rc"] == 0 for s in data["steps"])

    fetch = data["fetch"]
    assert fetch["verified"] is True and fetch["bytes"] == 16 << 20
    # NIXL's path where NIXL is installed (make venv installs it), else skipped with why.
    nixl = {"nixl"} if "paths_skipped" not in fetch else set()
    assert set(fetch["paths"]) == {"tcp-data", "tcp", "shm", *nixl}
    if nixl:
        assert fetch["paths"]["nixl"]["path"] == "nixl"
    else:
        assert "NIXL cannot be used here" in fetch["paths_skipped"]["nixl"]
    for name, path in fetch["paths"].items():
        assert path["cold"]["corrupt"] == 0 and path["cold"]["blocks"] == fetch["blocks"], name
        assert path["cold"]["gbps"] > 0
        assert all(w["exact"] for w in path["into_staging"]), name
    assert fetch["engine"]["load"]["exact"] and fetch["engine"]["save"]["exact"]
    tests = data["pytest"]
    assert tests["failed"] == tests["errors"] == 0 and tests["passed"] > 0
    assert len(tests["cuda_tests"]) >= 2

    if not CUDA:
        assert "CUDA: NOT AVAILABLE" in proc.stdout
        assert "RESULT: OK (dry run, CUDA not available)" in proc.stdout
        assert {t["outcome"] for t in tests["cuda_tests"]} == {"skipped"}
        assert fetch["pools"]["default"]["memory_kind"] == "pageable"
        assert fetch["pools"]["default"]["page_aligned"] is True
        assert fetch["paths"]["tcp-data"]["memory_kind"] == "pageable"
        assert fetch["engine"]["device"] == "cpu" and not fetch["engine"]["copy_stream"]
        assert "skipped" in fetch["raw"]
        assert fetch["nixl_vram"] == {"skipped": "no CUDA"}

    # What comes back from the device: at most 8 files, plain names, no folder.
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["gpu_check.json", "summary.txt", "env.txt", "install.log",
                            "pytest.log", "pytest.xml", "fetch.log"])
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    assert (out / "summary.txt").read_text().splitlines() == data["summary"]


def test_a_spent_budget_still_ends_in_a_failed_report(tmp_path: Path) -> None:
    proc, out = run_check(tmp_path, GPU_CHECK_BUDGET_S="20")
    assert proc.returncode == 1
    data = report(out)
    assert data["ok"] is False
    assert data["steps"] and all(s["timed_out"] for s in data["steps"])
    assert "RESULT: FAILED" in proc.stdout


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_required_cuda_fails_without_it(tmp_path: Path) -> None:
    proc, out = run_check(tmp_path, GPU_CHECK_BUDGET_S="20", GPU_CHECK_REQUIRE_CUDA="1")
    assert proc.returncode == 1
    assert any("CUDA required" in p for p in report(out)["problems"])

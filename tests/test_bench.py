"""``p2pkv-node bench --quick``: one real run, checked for structure and verified bytes.

Speed is never asserted here (the machine is shared and noisy); the table's
targets are for people reading it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from p2pkv.nixl import unavailable_reason

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BULK = ("bulk seed V2 (12 x 48 KiB)", "bulk seed V1 (1 x 576 KiB)",
        "bulk Llama-3-8B V2 (32 x 64 KiB)", "bulk 16 KiB blocks (V1)")
LOOKUPS = tuple(f"lookup {n} keys, {when}" for n in ("1,000", "10,000")
                for when in ("idle", "during bulk fetch"))
# A quick run READs the first NIXL case over each transport (a full run, every case).
NIXL = tuple(f"{title} seed V2 (12 x 48 KiB)" for title in (
    "NIXL read over UCX TCP", "NIXL read, same host (UCX default: CMA)"))
FIELDS = {"case", "metric", "value", "baseline", "ratio", "target", "met", "verified",
          "baseline_kind", "details", "error"}


def _command() -> list[str]:
    script = Path(sys.executable).with_name("p2pkv-node")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "p2pkv.cli"]


def test_quick_bench_runs_every_case_and_verifies_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    try:
        proc = subprocess.run([*_command(), "bench", "--quick", "--json", str(out),
                               "--plot", str(tmp_path / "bench.png")],
                              capture_output=True, text=True, timeout=200)
    except subprocess.TimeoutExpired as exc:  # subprocess.run killed the child already
        pytest.fail(f"bench --quick did not finish within 200 s: {exc.stderr!r:.3000}")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"

    data = json.loads(out.read_text())
    assert data["mode"] == "quick"
    assert data["ok"] is True and data["errors"] == []
    assert "ROUTER" in data["baseline"] and "DEALER" in data["baseline"]
    assert data["machine"]["nproc"] >= 1 and data["machine"]["python"]

    rows = data["cases"]
    by_case: dict[str, list[dict[str, object]]] = {}
    for row in rows:
        assert set(row) == FIELDS, row
        assert row["error"] is None, row
        assert row["verified"] is True, f"bytes not verified: {row}"
        value, baseline = row["value"], row["baseline"]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, row
        assert isinstance(baseline, float) and math.isfinite(baseline) and baseline > 0, row
        assert row["ratio"] == pytest.approx(value / baseline), row
        assert row["met"] in (True, False, None)
        by_case.setdefault(str(row["case"]), []).append(row)
        # The printed table carries every row too.
        assert str(row["case"]) in proc.stdout

    for name in BULK:
        (row,) = by_case[name]
        details = row["details"]
        assert isinstance(details, dict)
        assert row["metric"] == "fetch GB/s" and row["met"] in (True, False)
        assert details["raw_verified"] is True and details["node_verified"] is True
        # Bytes really moved: every round of both sides moved the whole dataset.
        assert details["bytes_per_side"] >= data["plan"]["bulk_bytes"] * 0.9
        assert len(details["node_round_gbps"]) == len(details["raw_round_gbps"]) >= 2
        # The kernel's own ceiling for the same bytes, measured in the same run.
        (ceiling,) = by_case[f"{name} vs kernel"]
        assert "recvmsg_into" in str(ceiling["baseline_kind"])
        assert isinstance(ceiling["details"], dict)
        assert ceiling["details"]["kernel_verified"] is True
        assert len(ceiling["details"]["kernel_round_gbps"]) >= 2
        # The data channel (tcp-data-v1) against the same ceiling, in the same run.
        (stream,) = by_case[f"{name} on the data channel vs kernel"]
        sd = stream["details"]
        assert isinstance(sd, dict) and sd["data_path"].startswith("tcp-data")
        assert sd["checksums"] is True and stream["met"] in (True, False)
        assert sd["kernel_verified"] is True and sd["node_verified"] is True
        assert len(sd["node_round_gbps"]) == len(sd["kernel_round_gbps"]) >= 2
    # NIXL (nixl-v1) against the data stream of the same case, where NIXL can be used.
    if unavailable_reason() is None:
        for name in NIXL:
            (row,) = by_case[name]
            nd = row["details"]
            assert isinstance(nd, dict) and nd["data_path"] == "nixl (nixl-v1)", row
            assert nd["transport"] in ("UCX tcp on loopback", "UCX same-host (cma)")
            assert nd["nixl_verified"] is True and nd["stream_verified"] is True
            assert len(nd["nixl_round_gbps"]) == len(nd["stream_round_gbps"]) >= 2
            for side in ("nixl", "stream"):
                for who in ("holder", "reader"):
                    assert nd[f"{side}_{who}_cpu_s_per_gb"] >= 0, row
            assert f"spread {name}:" in proc.stdout
    else:
        assert not any(name.startswith("NIXL") for name in by_case)
        assert any(s.startswith("NIXL rows: ") for s in data["skipped"])
        assert "skipped: NIXL rows: " in proc.stdout
    for name in LOOKUPS:
        assert sorted(str(r["metric"]) for r in by_case[name]) == ["p50 ms", "p99 ms"]
    assert any(r["met"] is not None for r in by_case["lookup 10,000 keys, during bulk fetch"])
    assert sorted(str(r["metric"]) for r in by_case["handshake (connect to ready)"]) == [
        "p50 ms", "p99 ms"]
    assert any(name.startswith("checksums on vs off") for name in by_case)
    (mem,) = [r for name, rs in by_case.items() if name.startswith("receiver peak RSS")
              for r in rs]
    assert isinstance(mem["details"], dict) and mem["details"]["pool_mib"] > 0
    # The plot: every bulk layout with its four bars' figures, drawn from these rows.
    png = (tmp_path / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    drawn = data["plot"]["bulk"]
    assert len(drawn) == len(BULK)
    for name in BULK:
        label = name[len("bulk "):]
        (row,) = by_case[name]
        assert drawn[label]["p2pkv, ZeroMQ"] == row["value"]
        assert drawn[label]["raw pyzmq"] == row["baseline"]
        assert set(drawn[label]) == {"kernel ceiling", "raw pyzmq", "p2pkv, data stream",
                                     "p2pkv, ZeroMQ"}
    assert f"plot: {tmp_path / 'bench.png'}" in proc.stdout
    stats = data["server_stats"]["node-server"]["nodes"]
    assert stats["seed-v2"]["protocol_violations"] == 0
    assert stats["seed-v2"]["bytes_sent"] > data["plan"]["bulk_bytes"]

"""Compare ``p2pkv-node bench`` of two commits in one sitting, rounds interleaved.

    python tools/bench_ab.py --base REV [--rounds 2] [--quick] [--json out.json]

The base commit is checked out in a temporary git worktree; each round runs the whole
bench once from the base tree and once from this checkout, in alternating order
(base, this; this, base; ...), so that drift of a shared machine hits both alike. Each
row is compared two ways: its own value (GB/s, ms, ...) and its ratio to the baseline
the bench measured beside it in the same run (raw pyzmq, the kernel, a block memcpy),
which cancels most of what the machine does between runs. The table prints the median
of each side and this/base, and marks a throughput row whose baseline ratio fell by
more than ``--tolerance`` (5 % by default). Exit status 0 whether or not a row fell:
the numbers are for a person to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def run_bench(tree: Path, quick: bool, out: Path, timeout: float) -> list[dict[str, Any]]:
    """One whole bench run of the p2pkv in ``tree``; its rows."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = ["bench", "--json", str(out), *(["--quick"] if quick else [])]
    code = f"import sys; from p2pkv.cli import main; sys.exit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, timeout=timeout,
                          capture_output=True, text=True, check=False)
    if not out.exists():
        raise SystemExit(f"bench in {tree} wrote no JSON (rc {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    rows: list[dict[str, Any]] = result["cases"]
    return rows


def key(row: dict[str, Any]) -> tuple[str, str]:
    return row["case"], row["metric"]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def compare(runs: dict[str, list[list[dict[str, Any]]]], tolerance: float
            ) -> tuple[list[dict[str, Any]], list[str]]:
    """Per row: the median value and baseline ratio of each side, and this/base."""
    order: list[tuple[str, str]] = []
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    ratios: dict[tuple[str, str], dict[str, list[float]]] = {}
    for side, side_runs in runs.items():
        for rows in side_runs:
            for row in rows:
                k = key(row)
                if k not in values:
                    order.append(k)
                    values[k] = {"base": [], "this": []}
                    ratios[k] = {"base": [], "this": []}
                if row.get("value") is not None:
                    values[k][side].append(float(row["value"]))
                if row.get("ratio") is not None:
                    ratios[k][side].append(float(row["ratio"]))
    table: list[dict[str, Any]] = []
    fell: list[str] = []
    for k in order:
        vb, vt = median(values[k]["base"]), median(values[k]["this"])
        rb, rt = median(ratios[k]["base"]), median(ratios[k]["this"])
        entry = {"case": k[0], "metric": k[1], "base": vb, "this": vt,
                 "value_change": None if not vb or vt is None else vt / vb,
                 "base_ratio": rb, "this_ratio": rt,
                 "ratio_change": None if not rb or rt is None else rt / rb}
        table.append(entry)
        change = entry["ratio_change"]
        if "GB/s" in k[1] and change is not None and change < 1 - tolerance:
            fell.append(f"{k[0]} {k[1]}: baseline ratio {rb:.3g} -> {rt:.3g}")
    return table, fell


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="bench --quick (noisier)")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--json", help="write the comparison here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per bench run")
    args = ap.parse_args(argv)
    runs: dict[str, list[list[dict[str, Any]]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="p2pkv-bench-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base],
                       cwd=HERE, check=True, capture_output=True)
        try:
            for r in range(args.rounds):
                sides = [("base", base), ("this", HERE)]
                for side, tree in sides if r % 2 == 0 else reversed(sides):
                    print(f"bench_ab: round {r + 1}/{args.rounds}: {side}", file=sys.stderr,
                          flush=True)
                    runs[side].append(run_bench(tree, args.quick,
                                                Path(tmp) / f"{side}-{r}.json", args.timeout))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=HERE,
                           check=False, capture_output=True)
    table, fell = compare(runs, args.tolerance)
    print(f"{'case':<46} {'metric':<22} {'base':>8} {'this':>8} {'this/base':>9} "
          f"{'ratio b':>8} {'ratio t':>8} {'t/b':>6}")
    for e in table:
        print(f"{e['case'][:46]:<46} {e['metric'][:22]:<22} {fmt(e['base']):>8} "
              f"{fmt(e['this']):>8} {fmt(e['value_change']):>9} {fmt(e['base_ratio']):>8} "
              f"{fmt(e['this_ratio']):>8} {fmt(e['ratio_change']):>6}")
    print(f"{args.rounds} round(s) each, interleaved; base {args.base}")
    for line in fell:
        print(f"fell by more than {args.tolerance:.0%}: {line}")
    if not fell:
        print(f"no throughput row fell by more than {args.tolerance:.0%} against its baseline")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "rounds": args.rounds,
                                               "quick": args.quick, "rows": table,
                                               "fell": fell}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark's output: one :class:`Row` per measurement, the table, the JSON."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import zmq

from p2pkv.checksum import NATIVE_VARIANT


@dataclass
class Row:
    """One line of the table (and one entry of the JSON ``cases``)."""

    case: str
    metric: str
    value: float | None
    baseline: float | None
    ratio: float | None
    target: str
    met: bool | None
    verified: bool
    baseline_kind: str = "raw pyzmq"
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def format_table(rows: Sequence[Row]) -> str:
    head = ("case", "metric", "p2pkv", "baseline", "ratio", "target", "met", "bytes ok")
    body = []
    for r in rows:
        met = "-" if r.met is None else ("met" if r.met else "NOT MET")
        if r.error:
            met = "ERROR"
        body.append((r.case, r.metric, fmt(r.value), fmt(r.baseline),
                     "-" if r.ratio is None else f"{r.ratio:.2f}x", r.target, met,
                     "yes" if r.verified else "NO"))
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for x in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip())
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "platform": platform.platform(),
            # The compiled copy helper of the same-host path, and its xxh3 build.
            "native_copy": NATIVE_VARIANT or "none (Python copy)"}


def error_row(case: str, metric: str, target: str, exc: Exception) -> Row:
    return Row(case, metric, None, None, None, target, False, False, error=str(exc))


def ratio_of(value: float, baseline: float) -> float | None:
    return value / baseline if baseline else None


def report(rows: list[Row], lines: Sequence[str], result: dict[str, Any], ok: bool,
            out: IO[str], json_path: str | None) -> int:
    """Print the table and the error lines, write the JSON when asked; the exit code."""
    print(format_table(rows), file=out)
    for line in lines:
        print(line, file=out)
    out.flush()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True, default=str)
    return 0 if ok else 1

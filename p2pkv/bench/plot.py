"""``p2pkv-node bench --plot FILE.png``: each bulk layout's GB/s against its baselines.

One group of bars per layout, all from the same run: the kernel's ceiling (plain TCP,
``sendmsg`` gather, ``recvmsg_into`` scatter), raw pyzmq (the node's frames without its
protocol), p2pkv on the data stream and p2pkv on ZeroMQ; the same-host rows (shared
memory against a block-by-block memcpy) in a second panel. Each p2pkv bar is labelled
with its ratio to the kernel's ceiling, the figure a target is judged by.

matplotlib is an optional extra (``pip install 'p2pkv[plot]'``); without it ``--plot``
stops before the bench starts, with that install line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from p2pkv.bench.report import Row
from p2pkv.errors import ConfigError

__all__ = ["bulk_series", "check_plotting", "plot_rows"]

#: Bars of one layout, in drawing order: (label in the legend, colour).
SERIES = (("kernel ceiling", "#7f7f7f"), ("raw pyzmq", "#bcbd22"),
          ("p2pkv, data stream", "#1f77b4"), ("p2pkv, ZeroMQ", "#aec7e8"))


def check_plotting() -> None:
    """Raise :class:`ConfigError` when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'p2pkv[plot]'",
                          option="plot") from None


def bulk_series(rows: Sequence[Row]) -> dict[str, dict[str, float]]:
    """``{layout: {series: GB/s}}`` of the bulk rows of one run (what was measured)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.error or r.value is None or r.metric != "fetch GB/s":
            continue
        if m := re.fullmatch(r"bulk (.+) on the data channel vs kernel", r.case):
            layout = out.setdefault(m[1], {})
            layout["p2pkv, data stream"] = r.value
            if r.baseline is not None:
                layout["kernel ceiling"] = r.baseline
        elif m := re.fullmatch(r"bulk (.+) vs kernel", r.case):
            layout = out.setdefault(m[1], {})
            if r.baseline is not None:
                layout["kernel ceiling"] = r.baseline
        elif m := re.fullmatch(r"bulk (.+)", r.case):
            layout = out.setdefault(m[1], {})
            layout["p2pkv, ZeroMQ"] = r.value
            if r.baseline is not None:
                layout["raw pyzmq"] = r.baseline
    # Other rows named "bulk ..." (checksums off, CURVE) are not layouts: a layout has
    # its ZeroMQ row (against raw pyzmq) and its kernel row.
    return {k: v for k, v in out.items() if "kernel ceiling" in v and "p2pkv, ZeroMQ" in v}


def same_host_series(rows: Sequence[Row]) -> dict[str, tuple[float, float]]:
    """``{layout: (shared memory GB/s, memcpy GB/s)}`` of the same-host rows."""
    out = {}
    for r in rows:
        if r.error or r.value is None or r.baseline is None or r.metric != "fetch GB/s":
            continue
        if m := re.fullmatch(r"same-host fetch (.+)", r.case):
            out[m[1]] = (r.value, r.baseline)
    return out


def _wrap(label: str) -> str:
    """``seed V2 (12 x 48 KiB)`` on two lines, so that tick labels do not overlap."""
    return label.replace(" (", "\n(", 1)


def plot_rows(rows: Sequence[Row], path: str, *, title: str = "") -> dict[str, Any]:
    """Draw the figure into ``path`` (PNG); what was drawn, for the caller's record."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bulk = bulk_series(rows)
    local = same_host_series(rows)
    if not bulk:
        raise ValueError("no bulk rows with figures to plot")
    panels = 2 if local else 1
    fig, axes = plt.subplots(1, panels, figsize=(11 if local else 8, 4.8),
                             gridspec_kw={"width_ratios": [3, 1] if local else [1]},
                             squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(SERIES)
    for i, values in enumerate(bulk.values()):
        kernel = values.get("kernel ceiling")
        for j, (name, colour) in enumerate(SERIES):
            value = values.get(name)
            if value is None:
                continue
            x = i + (j - (len(SERIES) - 1) / 2) * width
            ax.bar(x, value, width, color=colour, label=name if i == 0 else None)
            if name.startswith("p2pkv") and kernel:
                ax.text(x, value, f"{value / kernel:.2f}x", ha="center", va="bottom",
                        fontsize=7)
    ax.set_xticks(range(len(bulk)), [_wrap(name) for name in bulk], fontsize=8)
    ax.set_ylabel("GB/s (loopback, bytes verified)")
    ax.set_title("bulk fetch; labels: ratio to the kernel's ceiling", fontsize=9)
    top = max(v for values in bulk.values() for v in values.values())
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=len(SERIES))
    if local:
        ax2 = axes[0][1]
        names = list(local)
        for i, name in enumerate(names):
            shm, memcpy = local[name]
            ax2.bar(i - 0.2, memcpy, 0.4, color="#7f7f7f",
                    label="block memcpy" if i == 0 else None)
            ax2.bar(i + 0.2, shm, 0.4, color="#2ca02c",
                    label="p2pkv, shared memory" if i == 0 else None)
            ax2.text(i + 0.2, shm, f"{shm / memcpy:.2f}x", ha="center", va="bottom",
                     fontsize=7)
        ax2.set_xticks(range(len(names)), [_wrap(name) for name in names], fontsize=8)
        ax2.set_title("same host", fontsize=9)
        ax2.set_ylim(0, max(max(v) for v in local.values()) * 1.3)
        ax2.legend(fontsize=8, loc="upper center", ncol=1)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"bulk": bulk, "same_host": local}

"""What knowing an adapter by its content costs a request, in one run.

For adapters of each size in ``--mb`` (default: 3.7 MB, a rank-8 adapter of SmolLM2-135M
on q/k/v/o; 168 MB, rank 16 on every projection of a Llama-3-8B in fp16; 671 MB, rank
64), three ways a request meets its adapter:

- **first request**: the files are hashed (SHA-256; the files were just written, so they
  are in the page cache, as after the engine loaded the adapter). The request's lookups
  answer RETRY meanwhile, off the scheduler thread;
- **new process, digest cache**: a restarted engine reads the digests back by path,
  size, times and inode;
- **every later request**: the tier keeps the digest while the files keep their stat,
  which costs one directory scan on the scheduler thread.

Run: ``python -m p2pkv.bench.adapter [--mb 3.7,168,671] [--dir DIR] [--json PATH]``.
The files are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2pkv.identity.adapter import adapter_identity, adapter_signature

_CHUNK = 8 << 20


def _write(root: Path, nbytes: int) -> None:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    block = os.urandom(_CHUNK)
    with open(root / "adapter_model.safetensors", "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, _CHUNK)])
            left -= _CHUNK


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def measure(root: Path, nbytes: int, cache: Path) -> dict[str, Any]:
    _write(root, nbytes)
    started = time.perf_counter()
    first = adapter_identity(root, cache=cache)
    hashed = time.perf_counter() - started
    cached = _median([_timed(lambda: adapter_identity(root, cache=cache)) for _ in range(5)])
    again = adapter_identity(root, cache=cache)
    assert again.digest == first.digest and {f.source for f in again.files} == {"cache"}
    scan = _median([_timed(lambda: adapter_signature(root)) for _ in range(200)])
    return {"mb": nbytes / 1e6, "first_request_s": hashed,
            "first_request_gb_per_s": nbytes / hashed / 1e9,
            "digest_cache_s": cached, "later_request_s": scan, "digest": first.digest}


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2pkv.bench.adapter",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", default="3.7,168,671", help="adapter sizes, MB, comma-separated")
    ap.add_argument("--dir", default=None, help="where to write the adapters")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    try:
        sizes = [int(float(x) * 1e6) for x in args.mb.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--mb must be numbers separated by commas, got {args.mb!r}")
    if not sizes or min(sizes) <= 0:
        ap.error("--mb needs at least one positive size")
    base = Path(tempfile.mkdtemp(prefix="p2pkv-adapter-bench-", dir=args.dir))
    rows = []
    try:
        for i, nbytes in enumerate(sizes):
            rows.append(measure(base / f"a{i}", nbytes, base / "cache.json"))
            shutil.rmtree(base / f"a{i}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{'adapter':>10}  {'first request':>22}  {'digest cache':>13}  {'later requests':>15}")
    for r in rows:
        print(f"{r['mb']:>8.1f}MB  {r['first_request_s'] * 1e3:>9.1f} ms "
              f"({r['first_request_gb_per_s']:.2f} GB/s)  {r['digest_cache_s'] * 1e3:>10.2f} ms"
              f"  {r['later_request_s'] * 1e6:>12.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

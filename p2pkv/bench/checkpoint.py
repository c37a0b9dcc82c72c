"""What the ``model_weights`` digest costs: one checkpoint of ``--gb`` GB on disk, hashed
the ways a node meets it, in one run.

- **disk**: the files dropped from the page cache first (``posix_fadvise(DONTNEED)``
  after ``fsync``), as on a first start with a cold cache;
- **page cache**: read again right away, as when the engine has just loaded them;
- **digest cache**: a later start, the digests read back by path, size, times and inode;
- **Hugging Face blobs**: the same files as a hub-cache snapshot, where the blob names
  are the SHA-256 and nothing is read.

The checkpoint is ``--shards`` files (hashed in parallel, as a sharded checkpoint is).
Run: ``python -m p2pkv.bench.checkpoint --gb 16 [--shards 4] [--dir DIR] [--json PATH]``.
The files are removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2pkv.identity.checkpoint import checkpoint_identity

_CHUNK = 64 << 20


def _write_shard(path: Path, nbytes: int, salt: int) -> str:
    """Write ``nbytes`` of salted content; return its SHA-256 (computed while writing,
    so the hub-cache layout can be built without another read)."""
    block = bytearray(os.urandom(1 << 20)) * (_CHUNK >> 20)
    block[:8] = salt.to_bytes(8, "little")
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            part = memoryview(block)[:min(left, _CHUNK)]
            f.write(part)
            digest.update(part)
            left -= len(part)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def _drop_from_page_cache(files: list[Path]) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def run(gb: float, shards: int, root: Path) -> dict[str, Any]:
    total = int(gb * 1e9)
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    files, shas = [], []
    started = time.perf_counter()
    for i in range(shards):
        path = model / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        shas.append(_write_shard(path, total // shards, i))
        files.append(path)
    written = time.perf_counter() - started
    rows: dict[str, Any] = {"gb": total / 1e9, "shards": shards, "write_s": written,
                            "cpus": os.cpu_count()}
    dropped = _drop_from_page_cache(files)

    def timed(name: str, path: Path, cache: Path) -> None:
        t0 = time.perf_counter()
        ident = checkpoint_identity(path, cache=cache)
        seconds = time.perf_counter() - t0
        rows[name] = {"seconds": seconds, "gb_per_s": total / 1e9 / seconds if seconds else
                      None, "sources": sorted({f.source for f in ident.files}),
                      "model_weights": ident.model_weights}

    cache = root / "digests.json"
    timed("disk" if dropped else "first", model, cache)
    cache.unlink()
    timed("page_cache", model, cache)
    timed("digest_cache", model, cache)
    # The same bytes as a Hugging Face cache snapshot (links to blobs/<sha256>).
    repo = root / "hub" / "models--org--model"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for path, sha in zip(files, shas, strict=True):
        os.link(path, repo / "blobs" / sha)
        (snap / path.name).symlink_to(Path("../../blobs") / sha)
    timed("hf_blobs", snap, root / "other-digests.json")
    same = {rows[k]["model_weights"] for k in ("page_cache", "digest_cache", "hf_blobs")}
    rows["digests_equal"] = len(same) == 1
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a "
                    "temporary directory on the default file system)")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="p2pkv-ckpt-", dir=args.dir))
    try:
        rows = run(args.gb, args.shards, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name in ("disk", "first", "page_cache", "digest_cache", "hf_blobs"):
        if name in rows:
            r = rows[name]
            rate = f"{r['gb_per_s']:.2f} GB/s" if r["gb_per_s"] else "-"
            print(f"{name:13s} {r['seconds']:9.3f} s  {rate:>12s}  ({', '.join(r['sources'])})")
    print(f"{rows['gb']:.1f} GB in {rows['shards']} file(s), {rows['cpus']} CPUs; digests "
          f"equal: {rows['digests_equal']}")
    if args.json_path:
        args.json_path.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

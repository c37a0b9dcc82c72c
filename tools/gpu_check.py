"""The CUDA paths of p2pkv, checked on one machine: the steps ``tools/gpu_check.sh`` runs.

Subcommands (each writes one JSON file; ``tools/gpu_check.sh`` runs them under timeouts):

* ``env``: Python, torch, CUDA and the device, and where each runtime dependency of
  p2pkv was imported from.
* ``fetch``: the pool and the data path on this machine. Pools made as a node makes them
  (pinned where CUDA is available, page-aligned pageable memory otherwise; a shared pool
  registered with CUDA, made twice), then a producer process (``serve``, below) holding
  fill blocks (protocol/SPEC.md appendix A) and, in this process, one consumer node per
  path (the data stream, ZeroMQ frames, shared memory). Each consumer fetches every block
  into its own pool, then fetches them again into a pinned staging buffer
  (``fetch_into``); every byte is checked against the fill rule. The blocks of the first
  consumer's pool are then copied into CUDA tensors by ``EngineKVCopier`` (its copy
  stream) and back into a second pool, and the staging buffer is copied to the device
  and back in one piece, each verified and timed. Without CUDA the same steps run on
  CPU tensors and the device-only copies are reported as not run.
* ``serve``: the producer (internal: ``fetch`` starts it).
* ``summarize``: folds the step results, the pytest report (JUnit XML) and the JSON of
  the steps above into ``gpu_check.json`` and ``summary.txt``, prints the summary, and
  exits 0 only when every check that applies passed. Standard library only, so it
  reports even when torch or pyzmq cannot be imported.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from p2pkv.identity import RunConfig
    from p2pkv.layout import KVLayout

MODEL = "p2pkv/gpu-check"
#: What p2pkv imports at run time beyond the standard library: module -> distribution.
RUNTIME_MODULES = {"torch": "torch", "zmq": "pyzmq", "msgpack": "msgpack",
                   "xxhash": "xxhash", "numpy": "numpy"}
#: One consumer per data path: NodeConfig's (data_channel, shm).
PATHS: dict[str, tuple[bool, bool]] = {
    "tcp-data": (True, False),
    "tcp": (False, False),
    "shm": (True, True),
    "nixl": (True, False),  # one-sided NIXL reads (nixl-v1), where NIXL is installed
}
GB = 1e9


def _write_json(path: str, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / GB, 3) if seconds > 0 else 0.0


# ---------------------------------------------------------------------------- env


def cmd_env(args: argparse.Namespace) -> int:
    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                            "machine": platform.machine(), "modules": {}, "missing": []}
    for name, dist in RUNTIME_MODULES.items():
        try:
            module = __import__(name)
        except Exception as exc:
            info["missing"].append(f"{name}: {exc}")
            continue
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = str(getattr(module, "__version__", "?"))
        info["modules"][name] = {"version": version, "file": str(getattr(module, "__file__", "?"))}
    try:
        import p2pkv

        info["p2pkv"] = str(p2pkv.__file__)
    except Exception as exc:
        info["missing"].append(f"p2pkv: {exc}")
    info["cuda"] = False
    if "torch" in info["modules"]:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda"] = bool(torch.cuda.is_available())
        if info["cuda"]:
            props = torch.cuda.get_device_properties(0)
            info["device"] = {"name": props.name, "count": torch.cuda.device_count(),
                              "capability": f"{props.major}.{props.minor}",
                              "memory_gib": round(props.total_memory / 2**30, 1)}
    if "zmq" in info["modules"]:
        import zmq

        info["libzmq"] = zmq.zmq_version()
    _write_json(args.json, info)
    print(json.dumps(info, indent=2, sort_keys=True))
    return 1 if info["missing"] else 0


# ------------------------------------------------------------------------- common


def _layout(args: argparse.Namespace) -> KVLayout:
    from p2pkv.layout import make_layout, preset

    return make_layout(args.layout, preset(args.preset))


def _run_config(layout: KVLayout) -> RunConfig:
    from p2pkv.identity import RunConfig

    g = layout.geometry
    groups = [{"tokens_per_block": g.tokens_per_block,
               "layer_names": [f"model.layers.{i}.self_attn.attn"
                               for i in range(g.num_layers)]}]
    return RunConfig.resolve(MODEL, parallel_agnostic=True, dtype=g.dtype,
                             kv_cache_groups=groups, **layout.identity_flags())


def _keys(layout: KVLayout, blocks: int) -> list[bytes]:
    from p2pkv.fill import fill_keys

    return fill_keys(blocks, seed=0, tokens_per_hash=_run_config(layout).tokens_per_hash)


# -------------------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    """The producer: fill blocks in a node's pool until stdin closes."""
    from p2pkv.fill import fill_block
    from p2pkv.node import Node, NodeConfig
    from p2pkv.workers import say, wait_for_stdin_eof

    layout = _layout(args)
    node = Node(_run_config(layout), layout, pool_blocks=args.blocks + 8,
                config=NodeConfig(shm=True, send_timeout=60.0, nixl=_nixl_mode()))
    try:
        for key in _keys(layout, args.blocks):
            node.put(key, fill_block(key, layout.bytes_per_block))
        pool = node.store.pool
        say({"event": "ready", "address": node.address, "memory_kind": pool.memory_kind,
             "pinned": pool.pinned, "shm_unavailable": node.shm_unavailable})
        wait_for_stdin_eof(args.lifetime)
        stats = node.stats()
        say({"event": "served", "blocks_sent": stats.blocks_sent,
             "bytes_sent": stats.bytes_sent})
    finally:
        node.close()
    return 0


def _nixl_mode() -> str:
    """``on`` where NIXL can be used here (its path is then checked), else ``off``."""
    from p2pkv.nixl import unavailable_reason

    return "on" if unavailable_reason() is None else "off"


# -------------------------------------------------------------------------- fetch


class Check:
    """What the fetch step found: results, problems (failures) and warnings."""

    def __init__(self) -> None:
        self.result: dict[str, Any] = {}
        self.problems: list[str] = []
        self.warnings: list[str] = []

    def fail(self, text: str) -> None:
        print(f"PROBLEM: {text}", flush=True)
        self.problems.append(text)

    def warn(self, text: str) -> None:
        print(f"warning: {text}", flush=True)
        self.warnings.append(text)

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one part; an exception is a problem of that part, not the end."""
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:
            self.fail(f"{name}: {type(exc).__name__}: {exc}")
            value = None
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
        return value


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _is_pinned(tensor: torch.Tensor) -> bool:
    return _cuda() and bool(tensor.is_pinned())


def _host_allocator_bytes() -> int | None:
    """Bytes torch's pinned-memory allocator holds (None without CUDA or the stats)."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not torch.cuda.is_available() or stats is None:
        return None
    try:
        return int(stats().get("allocated_bytes.current", 0))
    except Exception:
        return None


def _pool_checks(check: Check, layout: KVLayout, cuda: bool) -> dict[str, Any]:
    from p2pkv.store.pool import PAGE_SIZE, BlockPool

    out: dict[str, Any] = {}
    before = _host_allocator_bytes()
    pool = BlockPool(layout, 4)
    after = _host_allocator_bytes()
    if before is not None and after is not None:
        # What the pool asked for (its regions plus the alignment page) against what
        # torch's caching host allocator took from CUDA for it (it rounds up).
        out["host_allocator"] = {"requested": pool.nbytes + PAGE_SIZE,
                                 "allocated_bytes": after - before}
    out["default"] = {"memory_kind": pool.memory_kind, "pinned": pool.pinned,
                      "is_pinned": _is_pinned(pool.kv_tensors[0]),
                      "page_aligned": all(p % PAGE_SIZE == 0 for p in pool.region_data_ptrs())}
    want = "pinned" if cuda else "pageable"
    if pool.memory_kind != want or out["default"]["is_pinned"] != cuda:
        check.fail(f"default pool is {out['default']}, expected {want} memory")
    if not out["default"]["page_aligned"]:
        check.fail("default pool regions are not page-aligned")
    del pool
    # A shared pool is registered with cudaHostRegister where CUDA is available. The
    # second one, made after the first is dropped, may land at the same address.
    for attempt in ("shared", "shared_again"):
        try:
            shared = BlockPool(layout, 4, shared=True)
        except Exception as exc:
            out[attempt] = {"error": f"{type(exc).__name__}: {exc}"}
            check.warn(f"{attempt} pool: {out[attempt]['error']}")
            continue
        out[attempt] = {"memory_kind": shared.memory_kind, "pinned": shared.pinned,
                        "is_pinned": _is_pinned(shared.kv_tensors[0])}
        want = "shared-pinned" if cuda else "shared"
        if shared.memory_kind != want:
            check.warn(f"{attempt} pool is {shared.memory_kind}, expected {want}")
        shared.close()
        del shared
        gc.collect()
    return out


def _expected(keys: Sequence[bytes], bpb: int) -> np.ndarray[Any, Any]:
    import numpy as np

    from p2pkv.fill import fill_block

    out = np.empty((len(keys), bpb), dtype=np.uint8)
    for i, key in enumerate(keys):
        out[i] = np.frombuffer(fill_block(key, bpb), dtype=np.uint8)
    return out


def _segment_slices(layout: KVLayout) -> list[tuple[int, int]]:
    offsets, at = [], 0
    for size in layout.segment_sizes:
        offsets.append((at, at + size))
        at += size
    return offsets


def _fetch_path(check: Check, name: str, address: str, layout: KVLayout,
                keys: list[bytes], expected: np.ndarray[Any, Any], staging: torch.Tensor,
                rounds: int, timeout: float) -> tuple[dict[str, Any], Any]:
    """One consumer: a cold fetch into its pool, then ``rounds`` into ``staging``.
    Returns the report and the node (open; the caller closes it)."""
    import numpy as np

    from p2pkv.node import Node, NodeConfig

    data_channel, shm = PATHS[name]
    node = Node(_run_config(layout), layout, pool_blocks=len(keys) + 8,
                config=NodeConfig(fetch_timeout=timeout, data_channel=data_channel, shm=shm,
                                  nixl=_nixl_mode() if name == "nixl" else "off"))
    try:
        pool = node.store.pool
        report: dict[str, Any] = {"memory_kind": pool.memory_kind,
                                  "pool_is_pinned": _is_pinned(pool.kv_tensors[0])}
        if _cuda():
            # A node's own pool is pinned where CUDA is; a shared one is registered
            # with CUDA, or stays pageable (logged) where registration is refused.
            if shm and pool.memory_kind != "shared-pinned":
                check.warn(f"{name}: the consumer's shared pool is {pool.memory_kind}")
            elif not shm and not (pool.memory_kind == "pinned"
                                  and report["pool_is_pinned"]):
                check.fail(f"{name}: the consumer's pool is {pool.memory_kind}, "
                           f"is_pinned {report['pool_is_pinned']}, with CUDA present")
            if not _is_pinned(staging):
                check.fail(f"{name}: the staging buffer is not pinned")
        peer = node.connect(address, timeout=30)
        report["path"] = peer.data_path
        if peer.data_path != name:
            check.warn(f"{name}: the fetch took the path {peer.data_path!r} "
                       f"({peer.data_path_detail})")
        nbytes = len(keys) * layout.bytes_per_block
        t0 = time.perf_counter()
        result = peer.fetch(keys, timeout=timeout)
        seconds = time.perf_counter() - t0
        corrupt = sum(1 for i, k in enumerate(keys)
                      if (data := node.get(k)) is None
                      or not np.array_equal(np.frombuffer(data, dtype=np.uint8), expected[i]))
        report["cold"] = {"blocks": len(result.landed), "bytes": nbytes, "seconds": seconds,
                          "gbps": _gbps(nbytes, seconds), "corrupt": corrupt,
                          "failed": len(result.failed), "missing": len(result.missing)}
        if len(result.landed) != len(keys) or corrupt:
            check.fail(f"{name}: cold fetch landed {len(result.landed)} of {len(keys)} "
                       f"blocks, {corrupt} not byte-exact, errors {result.errors}")
        # Again, into caller-owned pinned memory: the path an engine's staging takes.
        view = staging.numpy()
        cuts = _segment_slices(layout)
        destinations = [[view[i, a:b].data for a, b in cuts] for i in range(len(keys))]
        warm = []
        for _ in range(rounds):
            staging.zero_()
            t0 = time.perf_counter()
            result = node.fetch_into(peer, keys, destinations, timeout=timeout)
            seconds = time.perf_counter() - t0
            exact = bool(np.array_equal(view, expected))
            warm.append({"seconds": seconds, "gbps": _gbps(nbytes, seconds), "exact": exact,
                         "landed": len(result.landed)})
            if not exact or len(result.landed) != len(keys):
                check.fail(f"{name}: fetch_into landed {len(result.landed)} of {len(keys)} "
                           f"blocks, bytes exact: {exact}, errors {result.errors}")
        report["into_staging"] = warm
        report["staging_is_pinned"] = _is_pinned(staging)
        return report, node
    except BaseException:
        node.close(timeout=2)
        raise


def _nixl_into_vram(check: Check, staging: torch.Tensor, expected: np.ndarray[Any, Any],
                    rounds: int) -> dict[str, Any]:
    """One-sided NIXL READs of the pinned staging buffer (host memory an Exporter holds,
    as a node's pool) into a CUDA tensor an agent registered as VRAM: DRAM to VRAM with
    no host copy in between, where UCX has a CUDA transport. Every byte checked."""
    import numpy as np
    import torch

    from p2pkv.nixl import Exporter
    from p2pkv.nixl.agent import new_agent

    staging.copy_(torch.from_numpy(expected))  # what the fetches left there, for sure
    nbytes = staging.numel()
    exporter = Exporter("p2pkv-gpu-check-holder", [(staging.data_ptr(), nbytes)])
    device = torch.cuda.current_device()
    target = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    agent = new_agent("p2pkv-gpu-check-reader")
    registered = agent.register_memory([(target.data_ptr(), nbytes, device, "")], "VRAM")
    times, exact = [], []
    try:
        agent.add_remote_agent(exporter.metadata)
        for _ in range(rounds):
            target.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs([(target.data_ptr(), nbytes, device)], "VRAM"),
                agent.get_xfer_descs([(staging.data_ptr(), nbytes, 0)], "DRAM"),
                exporter.name, b"")
            state = agent.transfer(handle)
            deadline = time.monotonic() + 60
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(handle)
            got = target.cpu().numpy().reshape(expected.shape)
            exact.append(state == "DONE" and bool(np.array_equal(got, expected)))
        if not all(exact):
            check.fail(f"NIXL READ into VRAM: bytes exact per round {exact}")
        return {"bytes": nbytes,
                "rounds": [{"seconds": t, "gbps": _gbps(nbytes, t), "exact": e}
                           for t, e in zip(times, exact, strict=True)]}
    finally:
        agent.deregister_memory(registered)
        exporter.close()


def _timed(fn: Callable[[], object], sync: Callable[[], None], rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _engine_copies(check: Check, store: Any, layout: KVLayout, keys: list[bytes],
                   expected: np.ndarray[Any, Any], device: str, rounds: int) -> dict[str, Any]:
    """The pool's blocks into engine tensors on ``device`` (reversed block order) and
    back into a second pool, through :class:`EngineKVCopier`, verified."""
    import numpy as np
    import torch

    from p2pkv.layout import torch_dtype
    from p2pkv.store import BlockStore
    from p2pkv.store.engine import EngineKVCopier
    from p2pkv.store.pool import BlockPool

    n = len(keys)
    nbytes = n * layout.bytes_per_block
    dtype = torch_dtype(layout.geometry.dtype)
    engine = [torch.zeros(s, dtype=dtype, device=device) for s in layout.engine_shapes(n)]
    copier = EngineKVCopier(store, engine)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    items = [(keys[i], n - 1 - i) for i in range(n)]
    loaded: list[bool] = []

    def load() -> None:
        loaded[:] = copier.load_many(items)

    times = _timed(load, sync, rounds)
    exact = all(loaded) and len(loaded) == n
    for (a, b), tensor in zip(_segment_slices(layout), engine, strict=True):
        got = tensor.cpu().contiguous().view(torch.uint8).reshape(n, b - a).numpy()
        exact = exact and bool(np.array_equal(got, expected[::-1, a:b]))
    out: dict[str, Any] = {
        "device": device, "copy_stream": copier.uses_copy_stream, "blocks": n,
        "copies_per_batch": n * layout.num_segments, "bytes": nbytes,
        "load": {"seconds": times, "gbps": _gbps(nbytes, min(times)),
                 "gbps_first": _gbps(nbytes, times[0]), "exact": exact}}
    if not exact:
        check.fail(f"engine load into {device} tensors: bytes differ from the fill rule")
    back = BlockStore(BlockPool(layout, n))
    saver = EngineKVCopier(back, engine)
    saved: list[bool] = []
    t = _timed(lambda: saved.extend(saver.save_many([(n - 1 - i, keys[i]) for i in range(n)])),
               sync, 1)[0]
    exact = all(saved) and all(
        (data := back.get(k)) is not None
        and np.array_equal(np.frombuffer(data, dtype=np.uint8), expected[i])
        for i, k in enumerate(keys))
    out["save"] = {"seconds": t, "gbps": _gbps(nbytes, t), "exact": exact,
                   "pool": back.pool.memory_kind}
    if not exact:
        check.fail(f"engine save from {device} tensors: bytes differ from the fill rule")
    return out


def _raw_copies(check: Check, staging: torch.Tensor, expected: np.ndarray[Any, Any],
                rounds: int, device: str = "cuda") -> dict[str, Any]:
    """One piece: pinned -> device, pageable -> device, device -> pinned (CUDA only;
    ``device`` is there to try the code elsewhere)."""
    import numpy as np
    import torch

    nbytes = staging.numel()
    dev = torch.empty_like(staging, device=device)
    pageable = torch.from_numpy(expected)
    out: dict[str, Any] = {"bytes": nbytes, "staging_is_pinned": _is_pinned(staging)}

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for name, fn in (
        ("pinned_to_device", lambda: dev.copy_(staging, non_blocking=True)),
        ("pageable_to_device", lambda: dev.copy_(pageable, non_blocking=True)),
        ("device_to_pinned", lambda: staging.copy_(dev, non_blocking=True)),
    ):
        times = _timed(fn, sync, rounds)
        out[name] = {"seconds": times, "gbps": _gbps(nbytes, min(times))}
    exact = bool(np.array_equal(staging.numpy(), expected)) and bool(
        torch.equal(dev, pageable.to(device)))
    out["exact"] = exact
    if not exact:
        check.fail("raw host<->device copies: bytes differ")
    return out


def cmd_fetch(args: argparse.Namespace) -> int:
    import torch

    from p2pkv.workers import JsonLineProcess

    check = Check()
    cuda = bool(torch.cuda.is_available())
    layout = _layout(args)
    bpb = layout.bytes_per_block
    mib = args.mib or (1024 if cuda else 64)
    blocks = max(1, mib * 2**20 // bpb)
    res = check.result
    res.update({"cuda": cuda, "layout": layout.name, "preset": args.preset, "blocks": blocks,
                "bytes_per_block": bpb, "segments": layout.num_segments,
                "bytes": blocks * bpb})
    print(f"CUDA {'available' if cuda else 'NOT available: pageable memory, CPU tensors'}; "
          f"{blocks} blocks of {bpb} bytes ({layout.name}, {args.preset}, "
          f"{layout.num_segments} segments)", flush=True)
    res["pools"] = check.step("pools", lambda: _pool_checks(check, layout, cuda))
    keys = _keys(layout, blocks)
    expected = check.step("expected bytes", lambda: _expected(keys, bpb))
    if expected is None:
        return _finish(check, args)
    producer = JsonLineProcess(
        [sys.executable, str(Path(__file__).resolve()), "serve", "--layout", args.layout,
         "--preset", args.preset, "--blocks", str(blocks), "--lifetime", str(args.timeout * 4)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    nodes: list[Any] = []
    try:
        ready = check.step("producer", lambda: producer.next(args.timeout))
        if ready is None or ready.get("event") != "ready":
            check.fail(f"producer did not start: {ready} {producer.stderr_tail(2000)}")
            return _finish(check, args)
        res["producer"] = ready
        staging = torch.empty((blocks, bpb), dtype=torch.uint8, pin_memory=cuda)
        res["paths"] = {}
        for name in PATHS:
            if name == "nixl" and _nixl_mode() == "off":
                from p2pkv.nixl import unavailable_reason

                res["paths_skipped"] = {"nixl": f"NIXL cannot be used here: "
                                                f"{unavailable_reason()}"}
                continue
            got = check.step(f"fetch {name}", functools.partial(
                _fetch_path, check, name, ready["address"], layout, keys, expected, staging,
                args.rounds, args.timeout))
            if got is not None:
                res["paths"][name], node = got
                if nodes:  # the first consumer's pool feeds the engine copies
                    node.close(timeout=2)
                else:
                    nodes.append(node)
        if nodes:
            res["engine"] = check.step("engine copies", lambda: _engine_copies(
                check, nodes[0].store, layout, keys, expected, "cuda" if cuda else "cpu",
                args.rounds))
        else:
            check.fail("no consumer fetched: no engine copies")
        if cuda:
            res["raw"] = check.step("raw copies", lambda: _raw_copies(
                check, staging, expected, args.rounds))
        else:
            res["raw"] = {"skipped": "no CUDA: host<->device copies not measured"}
        if cuda and _nixl_mode() == "on":
            res["nixl_vram"] = check.step("NIXL into VRAM", lambda: _nixl_into_vram(
                check, staging, expected, args.rounds))
        else:
            res["nixl_vram"] = {"skipped": "no CUDA" if not cuda else
                                "NIXL cannot be used here"}
    finally:
        for node in nodes:
            node.close(timeout=2)
        producer.close_stdin()
        served = None
        try:
            served = producer.next(15)
        except Exception as exc:
            check.warn(f"producer did not report: {exc!r}")
        res["producer_served"] = served
        producer.kill()
    return _finish(check, args)


def _finish(check: Check, args: argparse.Namespace) -> int:
    res = check.result
    paths = res.get("paths", {})
    res["verified"] = bool(paths) and not check.problems and all(
        p["cold"]["corrupt"] == 0 and p["cold"]["blocks"] == res["blocks"]
        for p in paths.values())
    res["problems"], res["warnings"] = check.problems, check.warnings
    _write_json(args.json, res)
    return 0 if res["verified"] else 1


# ---------------------------------------------------------------------- summarize


def _pytest_report(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"error": f"no report at {path.name}"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {"error": f"unreadable report: {exc}"}
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    cuda_tests, failures = [], []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            child = case.find(tag)
            if child is not None:
                outcome, message = name, child.get("message", "")[:300]
                break
        counts[outcome] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if outcome in ("failed", "errors"):
            failures.append(f"{name}: {message}")
        # The tests that need CUDA (they skip without it), not the ones for machines
        # without it.
        if "cuda" in name.lower() and "without_cuda" not in name.lower():
            cuda_tests.append({"name": name, "outcome": outcome, "message": message})
    return {**counts, "cuda_tests": cuda_tests, "failures": failures}


def _load(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _steps(path: Path) -> list[dict[str, Any]]:
    steps = []
    if path.is_file():
        for line in path.read_text().splitlines():
            name, rc, seconds, limit = line.split("\t")
            steps.append({"name": name, "rc": int(rc), "seconds": int(seconds),
                          "timeout_s": int(limit), "timed_out": int(rc) in (124, 137)})
    return steps


def _fmt_path(name: str, p: dict[str, Any]) -> str:
    cold = p.get("cold", {})
    warm = " / ".join(f"{w['gbps']:.2f}" for w in p.get("into_staging", []))
    return (f"  {name:<9} path {p.get('path', '?'):<8} cold {cold.get('gbps', 0):.2f} GB/s "
            f"into its {p.get('memory_kind', '?')} pool, {cold.get('corrupt', '?')} corrupt; "
            f"into {'pinned' if p.get('staging_is_pinned') else 'pageable'} staging "
            f"{warm} GB/s")


def _summary_lines(s: dict[str, Any]) -> list[str]:
    env, fetch, tests = s["env"], s["fetch"], s["pytest"]
    lines = [f"p2pkv GPU check, {s['finished']}, {s['elapsed_s']} s"]
    if s["cuda"]:
        dev = env.get("device", {})
        lines.append(f"CUDA: available: {dev.get('name', '?')} x{dev.get('count', '?')} "
                     f"(torch {env.get('modules', {}).get('torch', {}).get('version', '?')}, "
                     f"CUDA {env.get('torch_cuda')})")
    else:
        lines.append("CUDA: NOT AVAILABLE. Dry run: the CUDA tests skip, pools are "
                     "page-aligned pageable memory, engine copies run on CPU tensors, "
                     "no host->device figure is measured.")
    zmq_mod = env.get("modules", {}).get("zmq", {})
    lines.append(f"python {env.get('python', '?')}; p2pkv from {env.get('p2pkv', '?')}; pyzmq "
                 f"{zmq_mod.get('version', 'MISSING')} from {zmq_mod.get('file', '?')}")
    lines.append("steps: " + ", ".join(
        f"{st['name']} " + ("TIMED OUT" if st["timed_out"] else f"rc={st['rc']}")
        + f" ({st['seconds']} s)" for st in s["steps"]))
    if "error" in tests:
        lines.append(f"pytest: {tests['error']}")
    else:
        lines.append(f"pytest: {tests['passed']} passed, {tests['failed']} failed, "
                     f"{tests['errors']} errors, {tests['skipped']} skipped")
        for t in tests["cuda_tests"]:
            lines.append(f"  {t['outcome']:<7} {t['name']}"
                         + (f" ({t['message']})" if t["message"] else ""))
    pools = fetch.get("pools") or {}
    if pools:
        lines.append("pool: " + ", ".join(
            f"{k} {v.get('memory_kind', v.get('error', '?'))}" for k, v in pools.items()
            if k != "host_allocator"))
        if "host_allocator" in pools:
            ha = pools["host_allocator"]
            lines.append(f"  a pinned pool of {ha['requested']} bytes took "
                         f"{ha['allocated_bytes']} bytes of torch's pinned allocator")
    if fetch.get("blocks"):
        lines.append(f"fetch: {fetch['blocks']} blocks x {fetch['bytes_per_block']} bytes "
                     f"({fetch['preset']} {fetch['layout']}, {fetch['segments']} segments) = "
                     f"{fetch['bytes'] / GB:.2f} GB; producer pool "
                     f"{(fetch.get('producer') or {}).get('memory_kind', '?')}")
        paths = fetch.get("paths") or {}
        for name in sorted(paths, key=lambda n: list(PATHS).index(n) if n in PATHS else 99):
            lines.append(_fmt_path(name, paths[name]))
    eng = fetch.get("engine") or {}
    if eng:
        load, save = eng.get("load", {}), eng.get("save", {})
        arrow = "host->cuda" if eng.get("device") == "cuda" else "host->host (CPU tensors)"
        lines.append(f"engine: EngineKVCopier, {eng.get('copies_per_batch')} copies a batch, "
                     f"copy stream {eng.get('copy_stream')}: load {arrow} {load.get('gbps')} "
                     f"GB/s (first {load.get('gbps_first')}), exact {load.get('exact')}; "
                     f"save back {save.get('gbps')} GB/s, exact {save.get('exact')}")
    raw = fetch.get("raw") or {}
    if "skipped" in raw:
        lines.append(f"raw copies: {raw['skipped']}")
    elif raw:
        lines.append("raw copies, one piece: " + ", ".join(
            f"{k.replace('_', ' ')} {raw[k]['gbps']} GB/s"
            for k in ("pinned_to_device", "pageable_to_device", "device_to_pinned")
            if k in raw) + f"; exact {raw.get('exact')}")
    vram = fetch.get("nixl_vram") or {}
    if "skipped" in vram:
        lines.append(f"NIXL into VRAM: skipped ({vram['skipped']})")
    elif vram:
        lines.append("NIXL into VRAM: " + ", ".join(
            f"{r['gbps']} GB/s exact {r['exact']}" for r in vram.get("rounds", [])))
    for w in s["warnings"]:
        lines.append(f"warning: {w}")
    for p in s["problems"]:
        lines.append(f"PROBLEM: {p}")
    if s["ok"]:
        lines.append("RESULT: OK" + ("" if s["cuda"] else " (dry run, CUDA not available)"))
    else:
        lines.append("RESULT: FAILED")
    return lines


def cmd_summarize(args: argparse.Namespace) -> int:
    work, out = Path(args.work), Path(args.out)
    env, fetch = _load(work / "env.json"), _load(work / "fetch.json")
    tests = _pytest_report(out / "pytest.xml")
    steps = _steps(work / "steps.tsv")
    cuda = bool(env.get("cuda"))
    problems: list[str] = []
    for st in steps:
        if st["rc"] != 0:
            problems.append(f"step {st['name']}: "
                            + ("timed out" if st["timed_out"] else f"exit status {st['rc']}"))
    problems += env.get("missing", [])
    notes = work / "problems.txt"  # what the shell script found (no wheel to install)
    if notes.is_file():
        problems += [line for line in notes.read_text().splitlines() if line.strip()]
    if "error" in tests:
        problems.append(f"pytest: {tests['error']}")
    else:
        problems += [f"pytest: {f}" for f in tests["failures"]]
        if not tests["cuda_tests"]:
            problems.append("pytest: no CUDA test was collected")
        for t in tests["cuda_tests"]:
            if cuda and t["outcome"] != "passed":
                problems.append(f"CUDA test not passed with CUDA present: {t['name']}")
    problems += fetch.get("problems", [])
    if not fetch.get("verified"):
        problems.append("fetch: bytes not verified")
    if args.require_cuda and not cuda:
        problems.append("CUDA required (GPU_CHECK_REQUIRE_CUDA=1) but not available")
    summary: dict[str, Any] = {
        "ok": not problems, "cuda": cuda, "dry_run": not cuda,
        "require_cuda": args.require_cuda, "problems": problems,
        "warnings": fetch.get("warnings", []), "env": env, "steps": steps,
        "pytest": tests, "fetch": fetch, "elapsed_s": args.elapsed,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lines = _summary_lines(summary)
    summary["summary"] = lines
    _write_json(str(out / "gpu_check.json"), summary)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if summary["ok"] else 1


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split(
        "\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env")
    p.add_argument("--json", required=True)
    for name in ("fetch", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--layout", default="v2", choices=("v1", "v2"))
        p.add_argument("--preset", default="llama-3-8b")
        if name == "fetch":
            p.add_argument("--json", required=True)
            p.add_argument("--mib", type=int, default=0,
                           help="MiB to fetch (default 1024 with CUDA, 64 without)")
            p.add_argument("--rounds", type=int, default=3)
            p.add_argument("--timeout", type=float, default=60.0,
                           help="seconds for the producer's start and for each fetch")
        else:
            p.add_argument("--blocks", type=int, required=True)
            p.add_argument("--lifetime", type=float, default=240.0)
    p = sub.add_parser("summarize")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--elapsed", type=int, default=0)
    p.add_argument("--require-cuda", action="store_true")
    args = parser.parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "env": cmd_env, "serve": cmd_serve, "fetch": cmd_fetch, "summarize": cmd_summarize}
    return commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

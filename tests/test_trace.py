"""The trace workload (``p2pkv/bench/serving/trace.py``, over ``mooncake.py``).

- The pure parts, in the main environment, each well under a second: reading a Mooncake
  trace (every refusal names its line and its problem), the committed window, cutting a
  window by time or count, the block mapping (equal ids give equal tokens, different ids
  different ones; a partial last block keeps its share of a block; caps), the schedule,
  the summary and the command's exits.
- The replayer (it needs ``aiohttp``, so it runs as the command, on the vLLM
  environment's Python): against a small HTTP server of the test's own that answers like
  vLLM's streaming completions, with an error, or not at all, the requests go out on the
  schedule whatever the earlier ones do, a stalled request ends at its timeout, and each
  failure is recorded with its cause; then against one real ``vllm serve`` engine, every
  request of a small trace succeeds with its TTFT measured and its full output, and the
  engine serves repeated prefixes from its prefix cache.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from vllmenv import REQUIRED, ROOT, VLLM_PY, serve, smollm2

from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.clients import complete
from p2pkv.bench.serving.mooncake import (
    DEFAULT_TRACE,
    VOCAB_HIGH,
    VOCAB_LOW,
    BlockMapping,
    MappedRequest,
    TraceRequest,
    TraceWindow,
    block_token_ids,
    cut_window,
    load_trace,
    map_requests,
    schedule,
    window_stats,
    write_mapped,
)
from p2pkv.bench.serving.trace import Replay, RequestResult, main


def line(ts: int, length: int, ids: list[int], out: int = 10) -> str:
    return json.dumps({"timestamp": ts, "input_length": length, "output_length": out,
                       "hash_ids": ids})


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def req(ts: int, length: int, ids: list[int], out: int = 10) -> TraceRequest:
    return TraceRequest(ts, length, out, tuple(ids))


# -- reading -------------------------------------------------------------------------------

def test_the_committed_window_reads_as_its_readme_says() -> None:
    trace = load_trace(DEFAULT_TRACE)
    assert len(trace) == 249
    assert (trace[0].timestamp_ms, trace[-1].timestamp_ms) == (131_999, 204_000)
    assert all(r.hash_ids[0] == 0 for r in trace)
    stats = window_stats(trace)
    assert stats["blocks"] == 6561 and round(stats["repeated_block_share"], 3) == 0.158
    assert stats["prefix_groups"] == 228
    readme = (DEFAULT_TRACE.parent / "README.md").read_text()
    for figure in ("249", "6,561", "15.8%", "228", "367", "615", "131,999", "204,000"):
        assert figure in readme, figure


@pytest.mark.parametrize(("bad", "problem"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"timestamp": 5, "output_length": 3, "hash_ids": [0]}', "missing field 'input_length'"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 3}', "missing field 'hash_ids'"),
    (line(5, -3, [0]), "input_length is -3"),
    (line(5, 10, [0], out=0), "output_length is 0"),
    (line(-1, 10, [0]), "timestamp is -1"),
    (line(5, 10, [-4]), "hash_ids must be a list of integers"),
    ('{"timestamp": 5, "input_length": true, "output_length": 3, "hash_ids": [0]}',
     "input_length must be an integer"),
    (line(5, 1025, [0, 1]), "input_length 1025 is 3 blocks of 512 tokens, but hash_ids has 2"),
    (line(5, 600, [0, 7]), "hash id 7 is a block of 88 tokens here but of 512 on line 1"),
    (line(0, 1024, [0, 9]), "timestamp 0 ms comes before the previous request's 1 ms"),
])
def test_a_bad_line_is_refused_with_its_number_and_problem(
        tmp_path: Path, bad: str, problem: str) -> None:
    path = write(tmp_path, line(1, 1100, [0, 7, 8]), "", bad)
    with pytest.raises(ValueError, match="line 3: ") as err:
        load_trace(path)
    assert problem in str(err.value)
    assert str(path) in str(err.value)


def test_an_empty_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        load_trace(write(tmp_path, "", ""))


# -- windows -------------------------------------------------------------------------------

TRACE = [req(1000 + 500 * i, 1024, [0, 100 + i]) for i in range(10)]  # every 0.5 s


def test_a_window_by_count_or_by_time_from_a_start() -> None:
    assert cut_window(TRACE, count=3) == TRACE[:3]
    assert cut_window(TRACE, 1.0, count=2) == TRACE[2:4]
    assert cut_window(TRACE, 1.0, duration_s=1.0) == TRACE[2:4]  # [1.0 s, 2.0 s)
    assert cut_window(TRACE, 4.0) == TRACE[8:]
    assert TraceWindow().cut(TRACE) == TRACE


@pytest.mark.parametrize(("window", "problem"), [
    (lambda: TraceWindow(0, 1.0, 3), "not both"),
    (lambda: TraceWindow(-1.0), "start"),
    (lambda: TraceWindow(0, 0.0), "duration"),
    (lambda: TraceWindow(0, None, 0), "count"),
    (lambda: TraceWindow(4.0, None, 3).cut(TRACE), "3 requests asked for, but the trace "
                                                   "has only 2 from 4 s on"),
    (lambda: TraceWindow(9.0).cut(TRACE), "no request in the window"),
])
def test_a_window_that_cannot_be_cut_says_why(window: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        window()


# -- the block mapping ---------------------------------------------------------------------

def test_equal_ids_give_equal_tokens_and_different_ids_different_ones() -> None:
    a = block_token_ids(7, 64, 64, seed=0)
    assert a == block_token_ids(7, 64, 64, seed=0) and len(a) == 64
    assert all(VOCAB_LOW <= t < VOCAB_HIGH for t in a)
    assert a != block_token_ids(8, 64, 64, seed=0)
    assert a != block_token_ids(7, 64, 64, seed=1)
    assert block_token_ids(7, 10, 64, seed=0) == a[:10]
    # Two requests sharing a prefix share exactly those tokens.
    one, two = map_requests([req(0, 1536, [0, 1, 2]), req(10, 1536, [0, 1, 3])],
                            BlockMapping())
    assert one.prompt[:128] == two.prompt[:128] and one.prompt[128:] != two.prompt[128:]


def test_a_partial_last_block_keeps_its_share_of_a_block() -> None:
    mapping = BlockMapping(block_tokens=64)
    cases = {1024 + 256: 32, 1024 + 1: 1, 1024 + 511: 64, 1024 + 4: 1, 1024 + 12: 2}
    for length, last in cases.items():
        (m,) = map_requests([req(0, length, [0, 1, 2])], mapping)
        assert [size for _, size in m.blocks] == [64, 64, last], length
        assert len(m.prompt) == 128 + last


def test_every_id_keeps_one_size_in_the_mapped_window() -> None:
    sizes: dict[int, set[int]] = {}
    for m in map_requests(load_trace(DEFAULT_TRACE), BlockMapping()):
        assert len(m.prompt) <= 3072 and 1 <= m.output_tokens <= 32
        for h, size in m.blocks:
            sizes.setdefault(h, set()).add(size)
    assert all(len(s) == 1 for s in sizes.values())


def test_caps_drop_trailing_blocks_partial_first_and_cut_the_output() -> None:
    mapping = BlockMapping(block_tokens=64, max_prompt_tokens=200, max_output_tokens=32)
    capped, short, exact = map_requests(
        [req(0, 3 * 512 + 100, [0, 1, 2, 3], out=500), req(0, 600, [0, 5], out=32),
         req(0, 3 * 512, [0, 6, 7])], mapping)
    assert [h for h, _ in capped.blocks] == [0, 1, 2] and len(capped.prompt) == 192
    assert capped.prompt_capped and capped.output_capped and capped.output_tokens == 32
    assert not short.prompt_capped and not short.output_capped
    assert [size for _, size in short.blocks] == [64, 11]
    assert not exact.prompt_capped and len(exact.prompt) == 192
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        BlockMapping(block_tokens=64, max_prompt_tokens=32)
    with pytest.raises(ValueError, match="block_tokens"):
        BlockMapping(block_tokens=513)


def test_the_schedule_is_trace_time_over_the_squeeze() -> None:
    mapped = map_requests(cut_window(TRACE, 1.0, count=3), BlockMapping())
    assert [m.offset_s for m in mapped] == [0.0, 0.5, 1.0]
    assert schedule(mapped, 2.0) == [0.0, 0.25, 0.5]
    assert schedule(mapped, 0.5) == [0.0, 1.0, 2.0]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="squeeze"):
            schedule(mapped, bad)


def test_window_stats_count_repeats_groups_and_caps() -> None:
    trace = [req(0, 1024, [0, 1]), req(0, 1536, [0, 1, 2]), req(0, 1100, [0, 3, 4])]
    stats = window_stats(trace, map_requests(trace, BlockMapping(max_prompt_tokens=128)))
    assert stats["blocks"] == 8 and stats["repeated_block_share"] == 3 / 8
    assert stats["requests_reusing_beyond_first_block"] == 1
    assert stats["prefix_groups"] == 2
    assert stats["mapped"]["prompt_tokens"] == 128 * 3
    assert stats["mapped"]["repeated_block_tokens"] == 64 * 3
    assert stats["mapped"]["prompts_capped"] == 2


def test_the_mapped_window_written_for_aiperf_keeps_one_size_per_id(tmp_path: Path) -> None:
    mapped = map_requests(load_trace(DEFAULT_TRACE), BlockMapping(max_prompt_tokens=1024))
    path = write_mapped(mapped, tmp_path / "mapped.jsonl", squeeze=0.5)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["timestamp"] for r in rows[:3]] == [0, 0, round(mapped[2].offset_s * 2000)]
    sizes: dict[int, int] = {}
    for row, m in zip(rows, mapped, strict=True):
        assert row["input_length"] == len(m.prompt) and row["output_length"] == m.output_tokens
        ids = row["hash_ids"]
        # aiperf's reading: whole blocks of 64, the rest in the last one.
        blocks = [64] * (len(ids) - 1) + [row["input_length"] - 64 * (len(ids) - 1)]
        assert 1 <= blocks[-1] <= 64
        for h, size in zip(ids, blocks, strict=True):
            assert sizes.setdefault(h, size) == size, h


# -- the summary and the command -----------------------------------------------------------

def test_summary_percentiles_failures_and_goodput() -> None:
    results = [RequestResult(i, i * 0.1, i * 0.1 + 0.002, ttft_s=(i + 1) * 0.1,
                             e2e_s=1.0, text=f"t{i}", output_tokens=4, status=200)
               for i in range(10)]
    results[3].error = "HTTP 500: boom"
    results[4].error = "timeout: no complete answer within 1 s"
    done = Replay(results, 1.0, 0.9, 2.0)
    s = done.summary((250.0,))
    assert (s["requests"], s["completed"], s["failed"]) == (10, 8, 2)
    assert s["failures"] == {"HTTP 500": 1, "timeout": 1}
    assert s["ttft"]["p50_ms"] == pytest.approx(650.0) and "p90_ms" in s["ttft"]
    assert s["schedule_lag"]["max_ms"] == pytest.approx(2.0)
    assert s["goodput"] == {"ttft<=250ms": pytest.approx(2 / 0.9)}  # requests 0 and 1
    assert s["output_tokens"] == 32
    assert done.texts()[3] == "" and done.texts()[5] == "t5"


def test_the_command_prints_stats_and_refuses_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--stats", "--count", "20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["requests"] == 20 and out["mapping"]["block_tokens"] == 64
    bad = write(tmp_path, line(0, 1024, [0, 1]), "oops")
    for argv, problem in (
            (["--stats", "--trace", str(bad)], "line 2: not JSON"),
            (["--stats", "--trace", str(tmp_path / "none.jsonl")], "No such file"),
            (["--stats", "--squeeze", "0"], "squeeze"),
            (["--stats", "--block-tokens", "0"], "block_tokens"),
            (["--count", "3"], "--url and --model are needed")):
        assert main(argv) == 2
        assert problem in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["--count", "3", "--duration-s", "2"])
    assert exited.value.code == 2


# -- the replayer --------------------------------------------------------------------------

def _need_vllm_python() -> None:
    if not VLLM_PY.exists():
        message = f"no vLLM environment at {VLLM_PY} (make vllm-env creates it)"
        pytest.fail(message) if REQUIRED else pytest.skip(message)


def replay_command(url: str, trace: Path, out: Path, *extra: str,
                   timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VLLM_PY), "-m", "p2pkv.bench.serving.trace", "--url", url, "--model", "m",
         "--trace", str(trace), "--json", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout)


class _Handler(BaseHTTPRequestHandler):
    """A prompt of one block streams three tokens as vLLM does; two blocks: HTTP 500;
    three: no answer until the test ends."""

    release: threading.Event

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        blocks = len(body["prompt"]) // 64
        if blocks == 3:
            self.release.wait(30)
            return
        if blocks == 2:
            self.send_error(500, "boom")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in ("", "a", "b"):  # a first token whose text is not whole yet
            chunk = {"choices": [{"index": 0, "text": text}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.05)
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def stub_server() -> Iterator[str]:
    release = threading.Event()
    handler = type("Handler", (_Handler,), {"release": release})
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_requests_go_out_on_schedule_whatever_the_earlier_ones_do(
        tmp_path: Path, stub_server: str) -> None:
    _need_vllm_python()
    trace = write(tmp_path, line(0, 1536, [0, 1, 2], out=5), line(300, 100, [3], out=5),
                  line(600, 1024, [4, 5], out=5), line(900, 512, [6], out=5))
    done = replay_command(stub_server, trace, tmp_path / "out.json", "--timeout", "2",
                          timeout=60)
    assert done.returncode == 1, done.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    stalled, first, failed, second = out["records"]
    assert stalled["error"].startswith("timeout") and stalled["ttft_s"] is None
    assert 1.9 < stalled["e2e_s"] < 5
    assert failed["status"] == 500 and failed["error"].startswith("HTTP 500")
    for ok, at in ((first, 0.3), (second, 0.9)):
        assert ok["error"] is None and ok["text"] == "ab" and ok["output_tokens"] == 5
        assert ok["ttft_s"] is not None and ok["ttft_s"] < ok["e2e_s"]
        assert ok["scheduled_s"] == pytest.approx(at)
        assert 0 <= ok["lag_s"] < 0.25  # not held back by the stalled request
    summary = out["summary"]
    assert (summary["completed"], summary["failed"]) == (2, 2)
    assert summary["failures"] == {"timeout": 1, "HTTP 500": 1}
    assert out["window"] == {"start_s": 0.0, "duration_s": None, "count": None}


#: Spaced turns of two conversations over a shared first block, in Mooncake's format
#: (a block is 64 tokens once mapped): each later turn extends its conversation's last.
SMALL_TRACE = [
    line(0, 4 * 512, [0, 1, 2, 3]),
    line(0, 3 * 512 + 256, [0, 10, 11, 14]),
    line(4000, 6 * 512, [0, 1, 2, 3, 4, 5]),
    line(4000, 3 * 512, [0, 20, 21]),
    line(8000, 4 * 512, [0, 10, 11, 12]),
    line(8000, 7 * 512 + 100, [0, 1, 2, 3, 4, 5, 6, 7]),
    line(12000, 2 * 512, [0, 30]),
    line(12000, 5 * 512, [0, 10, 11, 12, 13]),
    line(16000, 9 * 512, [0, 1, 2, 3, 4, 5, 6, 8, 9]),
    line(16000, 4 * 512, [0, 20, 21, 22]),
]
#: vLLM's KV block (``ServingCluster``'s ``--block-size``).
ENGINE_BLOCK = 32


def _shared(a: list[list[int]], b: list[list[int]]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += len(x)
    return n


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real ``vllm serve`` engine, no balancer, for this module's tests; stopped,
    and checked to leave nothing behind, after them."""
    _need_vllm_python()
    from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster

    cluster = ServingCluster(smollm2(), [EngineSpec("engine-0", free_port())],
                             tmp_path_factory.mktemp("cluster"), served_name="m",
                             balancer=None, python=str(VLLM_PY))
    yield from serve(cluster)


@pytest.mark.timeout(900)
def test_a_real_engine_serves_the_trace_and_its_repeated_prefixes_from_cache(
        tmp_path: Path, engine: Any) -> None:
    trace = write(tmp_path, *SMALL_TRACE)
    mapped: list[MappedRequest] = map_requests(load_trace(trace), BlockMapping())
    # A fresh engine's first request also pays its warm-up (seconds here): one of its
    # own first, sharing no token with the trace's, so that the turns below come after
    # their earlier turns have ended.
    complete(engine.url, "m", list(block_token_ids(1, 64, 64, seed=99)), 2, timeout=240)
    before = engine.metrics("engine-0")
    done = replay_command(engine.url, trace, tmp_path / "out.json", "--squeeze", "0.5",
                          "--max-output-tokens", "8", "--timeout", "240", timeout=420)
    after = engine.metrics("engine-0")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    records = out["records"]
    assert out["summary"]["failed"] == 0 and len(records) == len(SMALL_TRACE)
    for r in records:
        assert r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["e2e_s"], r
        assert r["output_tokens"] == 8 and r["text"], r  # ignore_eos: all 8 tokens
    # What the prefix cache must have served at least: for each request, the blocks it
    # shares with a request that had ended before it was sent, in whole engine blocks
    # (vLLM computes a prompt's last token again even when all of it is cached); and at
    # most what it shares with any other request sent before it ended (two requests sent
    # at once may reach the engine in either order).
    blocks = [[list(block_token_ids(h, size, 64, 0)) for h, size in m.blocks]
              for m in mapped]
    least = most = later_turns = 0
    for i, r in enumerate(records):
        ended = [j for j, q in enumerate(records)
                 if q["sent_s"] + q["e2e_s"] < r["sent_s"] and j != i]
        earlier = [j for j, q in enumerate(records)
                   if q["sent_s"] < r["sent_s"] + r["e2e_s"] and j != i]
        length = len(mapped[i].prompt)
        reusable = max((min(_shared(blocks[i], blocks[j]), length - 1) // ENGINE_BLOCK
                        * ENGINE_BLOCK for j in ended), default=0)
        least += reusable
        later_turns += reusable > 64  # more than the block every request starts with
        most += max((_shared(blocks[i], blocks[j]) for j in earlier), default=0)
    cached = (after["vllm:prompt_tokens_cached_by_source_total{source=device}"]
              - before.get("vllm:prompt_tokens_cached_by_source_total{source=device}", 0.0))
    assert later_turns >= 1, "no later turn came after its earlier turn ended: nothing tested"
    assert least <= cached <= most, (least, cached, most)


# -- aiperf as the second client -------------------------------------------------------------

def test_the_tokenizer_is_laid_out_as_a_hub_snapshot(tmp_path: Path) -> None:
    from p2pkv.bench.serving.aiperf_client import hub_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "config.json").write_text('{"model_type": "llama"}')
    assert hub_tokenizer(model, tmp_path / "hf", "local/m") == "local/m"
    repo = tmp_path / "hf" / "hub" / "models--local--m"
    snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "tokenizer.json"]
    with pytest.raises(ValueError, match="ORG/NAME"):
        hub_tokenizer(model, tmp_path / "hf", "m")
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        hub_tokenizer(tmp_path, tmp_path / "hf", "local/m")


def test_aiperf_s_export_reads_under_the_replay_s_names() -> None:
    from p2pkv.bench.serving.aiperf_client import summarize

    stat = {"p50": 10.0, "p90": 20.0, "p99": 30.0, "avg": 12.0}
    out = summarize({"request_count": {"avg": 5.0}, "completed_request_count": {"avg": 4.0},
                     "error_request_count": {"avg": 1.0}, "time_to_first_token": stat,
                     "request_latency": stat, "total_usage_completion_tokens": {"avg": 40},
                     "benchmark_duration": {"avg": 3.5}, "is_complete": True,
                     "error_summary": [{"code": 500, "count": 1}]})
    assert (out["requests"], out["completed"], out["failed"]) == (5, 4, 1)
    assert out["ttft"] == {"p50_ms": 10.0, "p90_ms": 20.0, "p99_ms": 30.0, "mean_ms": 12.0}
    assert out["output_tokens"] == 40 and out["complete"]
    assert out["schedule_lag"] == {"p50_ms": 0.0, "p99_ms": 0.0}  # absent: zero


def test_without_aiperf_the_command_says_where_it_looked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", "http://127.0.0.1:9", "--model", "m", "--count", "2", "--client",
            "aiperf", "--workdir", str(tmp_path)]
    assert main(argv) == 2
    assert "--client aiperf needs --tokenizer" in capsys.readouterr().err
    assert main([*argv, "--tokenizer", str(tmp_path), "--aiperf-bin",
                 str(tmp_path / "none")]) == 2
    assert f"no aiperf at {tmp_path / 'none'}" in capsys.readouterr().err


AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"


@pytest.mark.skipif(not AIPERF.exists(), reason=f"no aiperf at {AIPERF} (python3 -m venv "
                    ".venv-aiperf && .venv-aiperf/bin/pip install 'aiperf==0.13.*')")
@pytest.mark.timeout(900)
def test_aiperf_replays_the_same_window_against_the_real_engine(
        tmp_path: Path, engine: Any) -> None:
    from p2pkv.bench.serving.aiperf_client import run_aiperf

    mapped = map_requests(cut_window(load_trace(DEFAULT_TRACE), count=8),
                          BlockMapping(max_prompt_tokens=512, max_output_tokens=8))
    out = run_aiperf(engine.url, "m", mapped, tmp_path, block_tokens=64, squeeze=1.0,
                     tokenizer_dir=smollm2(), aiperf=AIPERF, timeout=600,
                     request_timeout=240)
    assert (out["requests"], out["completed"], out["failed"]) == (8, 8, 0), out
    assert out["complete"] and out["ttft"]["p50_ms"] > 0
    assert out["output_tokens"] == sum(m.output_tokens for m in mapped)

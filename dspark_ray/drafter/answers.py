"""The answers stage: the target's own answers to every prompt, by this project's engine.

Each prompt gets one answer, greedy or (``sampled_share`` of them) drawn at ``temperature`` with
a seed of its own; then ``followup_share`` of those conversations get a follow-up question
(``topics.FOLLOWUPS``) and a second answer, so the data holds multi-turn chats too. Prompts are
rendered with the target's chat template (``chat``), answers kept as token ids with the EOS the
target ended on. Progress is appended to answers.jsonl in chunks (by ``workers`` processes of one thread
each, their rows merged): an interrupted stage goes on where it stopped.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from dspark_ray.drafter import topics
from dspark_ray.drafter.config import RecipeConfig
from dspark_ray.drafter.workdir import StageRecord, WorkDir, say
from dspark_ray.drafter.workers import run_workers

CHUNK = 8  # engine batches per chunk written to disk
MIN_ROOM = 16  # a prompt leaving fewer positions than this in max_context is not answered


def engine_args(config: RecipeConfig) -> dict:
    """The engine's settings for generating: the whole batch resident (a KV pool of every slot at
    full context, so nothing is preempted and recomputed), no speculation."""
    return dict(max_context=config.max_context, capacity=config.gen_batch, max_num_seqs=config.gen_batch,
                kv_pool_tokens=config.gen_batch * config.max_context, device=config.device,
                enable_prefix_caching=True)


def render(tokenizer, messages: list[dict], chat: bool) -> list[int]:
    """A conversation as prompt token ids: the chat template with the assistant's header, or
    (``chat`` False, a model with no chat training) the messages' text as it is."""
    if chat:
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    return tokenizer.encode("\n".join(m["content"] for m in messages) + "\n", add_special_tokens=False)


def plan(config: RecipeConfig, prompts: list[dict]) -> list[dict]:
    """Per prompt: its answer's temperature and seed (fixed by the recipe's seed)."""
    rng = random.Random(config.seed + 2)
    return [{**p, "temperature": config.temperature if rng.random() < config.sampled_share else 0.0,
             "seed": config.seed * 1000 + i} for i, p in enumerate(prompts)]


def followups(config: RecipeConfig, answered: list[dict], tokenizer) -> list[dict]:
    """Second turns: ``followup_share`` of the first answers (in id order, whatever order the
    workers wrote them in), each with a follow-up question."""
    rng = random.Random(config.seed + 3)
    out = []
    for row in sorted(answered, key=lambda r: r["id"]):
        if row["turn"] == 1 and rng.random() < config.followup_share:
            reply = tokenizer.decode(row["answer_ids"], skip_special_tokens=True).strip()
            messages = row["messages"] + [{"role": "assistant", "content": reply},
                                          {"role": "user", "content": rng.choice(topics.FOLLOWUPS)}]
            out.append({"id": row["id"] + "-2", "source": row["source"], "split": row["split"], "turn": 2,
                        "messages": messages, "temperature": row["temperature"], "seed": row["seed"] + 500_000})
    return out


def generate(llm, config: RecipeConfig, todo: list[dict], path: Path, label: str = "answers") -> int:
    """Answer ``todo`` in chunks with the engine ``llm``, appending each chunk's rows to ``path``
    (a prompt that leaves no room to answer in max_context is skipped); returns the tokens made."""
    from dspark_ray import SamplingParams

    tok = llm.tokenizer
    eos = min(tok.eos_token_ids)
    made, step = 0, CHUNK * config.gen_batch
    for start in range(0, len(todo), step):
        chunk = [(r, render(tok, r["messages"], config.chat)) for r in todo[start:start + step]]
        chunk = [(r, p) for r, p in chunk if config.max_context - len(p) > MIN_ROOM]
        params = [SamplingParams(max_tokens=min(config.max_new_tokens, config.max_context - len(p) - 1),
                                 temperature=r["temperature"], seed=r["seed"]) for r, p in chunk]
        t0 = time.perf_counter()
        outs = llm.generate([p for _, p in chunk], params)
        rows = []
        for (r, p), o in zip(chunk, outs):
            if o.error:
                raise RuntimeError(f"answers: request {r['id']} failed in the engine: {o.error}")
            ids = list(o.token_ids)
            if o.finish_reason == "stop" and (not ids or ids[-1] not in tok.eos_token_ids):
                ids.append(eos)  # the target ended the answer: the drafter learns to say so
            rows.append({k: r[k] for k in ("id", "source", "split", "turn", "messages", "temperature", "seed")}
                        | {"prompt_ids": p, "answer_ids": ids, "finish": o.finish_reason})
        with path.open("a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        n = sum(len(o.token_ids) for o in outs)
        made += n
        say(f"{label}: {start + len(chunk)}/{len(todo)}, {n} tokens in {time.perf_counter() - t0:.0f} s "
            f"({n / (time.perf_counter() - t0):.0f} tok/s)")
    return made


def part_files(work: WorkDir) -> list[Path]:
    return sorted(work.root.glob("answers.part*.jsonl"))


def merge_parts(work: WorkDir) -> None:
    """Rows the workers finished (also those of an interrupted run) moved into answers.jsonl."""
    parts = part_files(work)
    if parts:
        with work.answers.open("a") as f:
            for part in parts:
                f.write(part.read_text())
        for part in parts:
            part.unlink()


def answer_rows(config: RecipeConfig, work: WorkDir, rows: list[dict]) -> int:
    """Answer ``rows`` into answers.jsonl: in this process, or split over ``workers`` processes of
    one thread each (on a 2-core box two one-thread engines beat one two-thread engine, and keep
    doing so when other work shares the machine). Returns the tokens made."""
    if not rows:
        return 0
    workers = min(config.workers, max(1, len(rows) // config.gen_batch))  # each with whole batches
    if workers <= 1:
        from dspark_ray import LLM

        return generate(LLM(config.target, None, **engine_args(config)), config, rows, work.answers)
    before = sum(len(r["answer_ids"]) for r in work.read_jsonl(work.answers))
    jobs = [{"config": config.to_json(), "rows": rows[i::workers], "out": str(work.root / f"answers.part{i}.jsonl"),
             "label": f"answers[{i}]"} for i in range(workers)]
    try:
        run_workers("answers", jobs, work.root)
    finally:
        merge_parts(work)
    return sum(len(r["answer_ids"]) for r in work.read_jsonl(work.answers)) - before


def run(config: RecipeConfig, work: WorkDir) -> StageRecord:
    from dspark_ray.tokenizer import Tokenizer

    prompts = work.read_jsonl(work.prompts)
    if not prompts:
        raise RuntimeError(f"answers: {work.prompts} is empty or missing; run the prompts stage first")
    merge_parts(work)
    have = {r["id"] for r in work.read_jsonl(work.answers)}
    first = [{**p, "turn": 1} for p in plan(config, prompts)]
    t0 = time.perf_counter()
    made = answer_rows(config, work, [r for r in first if r["id"] not in have])
    done = work.read_jsonl(work.answers)
    tokenizer = Tokenizer.from_path(config.target)
    made += answer_rows(config, work, [r for r in followups(config, done, tokenizer) if r["id"] not in have])
    seconds = time.perf_counter() - t0
    done = work.read_jsonl(work.answers)
    answer_tokens = sum(len(r["answer_ids"]) for r in done)
    details = {"answers": len(done), "turn2": sum(r["turn"] == 2 for r in done),
               "sampled": sum(r["temperature"] > 0 for r in done), "answer_tokens": answer_tokens,
               "prompt_tokens": sum(len(r["prompt_ids"]) for r in done),
               "finished_by_eos": sum(r["finish"] == "stop" for r in done), "workers": config.workers,
               "tokens_per_second": round(made / seconds, 1) if made else None}
    say(f"answers: {details}")
    return StageRecord(answer_tokens, details)


def run_job(job: dict) -> None:
    """A worker process's share (``workers.run_workers``): its own engine on one thread."""
    from dspark_ray import LLM

    config = RecipeConfig.from_json(job["config"])
    generate(LLM(config.target, None, **engine_args(config)), config, job["rows"], Path(job["out"]), job["label"])

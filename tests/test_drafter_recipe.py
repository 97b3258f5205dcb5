"""The drafter recipe (dspark_ray/drafter/) on the shipped toy pair, in CI-sized steps.

One run of every stage (the ``ci`` preset: a handful of prompts and answers, three optimizer
steps) makes a draft whose checkpoint loads and drafts inside the engine with greedy output
equal to the target alone; a second call skips every stage, ``force`` redoes a stage and the
ones after it; an interrupted training resumes to the same weights; a reduced vocabulary goes
through the whole recipe; the benchmark's prompts and their near-duplicates never become
training prompts. The recipe is never run at full size here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SHIPPED_TARGET, shipped
from safetensors.torch import load_file

from dspark_ray import LLM, SamplingParams
from dspark_ray.cli import main as cli_main
from dspark_ray.drafter import STAGE_NAMES, build_config, run_recipe
from dspark_ray.drafter import config as recipe_config
from dspark_ray.drafter import states as states_module
from dspark_ray.drafter import train as train_module
from dspark_ray.drafter.prompts import BenchmarkFilter, build_prompts
from dspark_ray.drafter.workdir import WorkDir
from dspark_ray.model import load
from dspark_ray.model.dspark import load_dspark

RAN = ["prompts", "answers", "states", "train", "confidence", "measure", "card"]  # no sweep in the ci preset


def ci_config(tmp: Path, **fields):
    return build_config(shipped(SHIPPED_TARGET, "model.safetensors"), tmp / "out", tmp / "work", preset="ci", **fields)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The whole recipe once, on the toy pair."""
    config = ci_config(tmp_path_factory.mktemp("recipe"))
    log = run_recipe(config)
    return config, log


def test_every_stage_ran_and_recorded_its_tokens_and_time(recipe):
    config, log = recipe
    assert list(log) == RAN
    assert all(entry["seconds"] >= 0 and "tokens" in entry for entry in log.values())
    assert log["answers"]["answers"] > log["answers"]["turn2"] > 0  # follow-up turns too
    assert log["answers"]["sampled"] > 0 and log["states"]["tokens"] > log["answers"]["tokens"]
    assert log["train"]["steps"] == config.steps and log["train"]["row_tokens"] > 0
    card = (config.out / "README.md").read_text()
    for section in ("## Data", "## Training", "## Acceptance against training tokens", "## In the engine", "## Time"):
        assert section in card


def test_the_draft_loads_and_drafts_in_the_engine_losslessly(recipe):
    config, _ = recipe
    target = load(config.target, dtype="float32")
    draft = load_dspark(config.out, target)
    assert draft.config.block_size == config.draft.block_size and draft.confidence_head is not None
    prompts = [r for r in WorkDir(config).read_jsonl(WorkDir(config).answers) if r["split"] == "heldout"]
    ids = [r["prompt_ids"] for r in prompts][:2] + [[5, 6, 7]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = LLM(config.target, None, max_context=128, capacity=4).generate(ids, params)
    spec = LLM(config.target, config.out, max_context=128, capacity=4, adaptive_speculation=False,
               num_speculative_tokens=4).generate(ids, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in alone]
    assert all(o.spec.drafts > 0 for o in spec)
    assert json.loads((config.work / "measure.json").read_text())["batch1"]["greedy_identical"]


def test_a_second_call_skips_every_stage_and_force_redoes_the_later_ones(recipe, tmp_path, monkeypatch):
    config, log = recipe
    work = tmp_path / "work"
    shutil.copytree(config.work, work)
    config = config.replace(work=work, out=tmp_path / "out")
    shutil.copytree(recipe[0].out, config.out)
    called = []
    from dspark_ray.drafter import recipe as recipe_module

    stages = tuple(s.__class__(s.name, lambda c, w, s=s: called.append(s.name) or s.run(c, w), s.outputs, s.about)
                   for s in recipe_module.STAGES)
    monkeypatch.setattr(recipe_module, "STAGES", stages)
    again = run_recipe(config)
    assert called == [] and again == log
    run_recipe(config, force=["confidence"])
    assert called == ["confidence", "measure", "card"]
    assert json.loads((work / "log.json").read_text())["stages"]["prompts"] == log["prompts"]


def test_an_interrupted_training_resumes_to_the_same_weights(recipe, tmp_path, monkeypatch):
    """Steps 1-2, a crash in step 3 (the checkpoint of step 2 stays), then the stage again: the
    draft equals the one trained without a stop."""
    config, _ = recipe
    results = {}
    for name in ("straight", "stopped"):
        work = tmp_path / name
        shutil.copytree(config.work, work)
        c = config.replace(work=work, out=tmp_path / f"{name}-out", save_every=2)
        if name == "stopped":
            real = train_module.lr_at

            def crash(step, *args, real=real):
                if step == 2:
                    raise KeyboardInterrupt("stopped in step 3")
                return real(step, *args)

            monkeypatch.setattr(train_module, "lr_at", crash)
            with pytest.raises(KeyboardInterrupt):
                run_recipe(c, stages=["train"], force=["train"])
            monkeypatch.setattr(train_module, "lr_at", real)
            assert (work / "train" / "checkpoint.pt").is_file() and not WorkDir(c).done("train")
            run_recipe(c, stages=["train"])
        else:
            run_recipe(c, stages=["train"], force=["train"])
        results[name] = load_file(c.out / "model.safetensors")
    assert results["straight"].keys() == results["stopped"].keys()
    for key, value in results["straight"].items():
        assert torch.equal(value, results["stopped"][key]), key


def test_worker_processes_give_the_same_answers_and_states(recipe, tmp_path, monkeypatch):
    """Answers and states split over two worker processes (python -m dspark_ray.drafter) equal those
    made in this process: each request's output does not depend on its batch (seeded sampling), and
    a row's states do not depend on its shard (up to the rounding of a padded forward of another
    length: the teacher batches rows of similar lengths)."""
    config, _ = recipe
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(config.work / "prompts.jsonl", work / "prompts.jsonl")
    c = config.replace(work=work, workers=2, gen_batch=4, followup_share=0.0)  # first turns: fewer start-ups
    monkeypatch.setattr(states_module, "SHARD_TOKENS", 300)  # several shards: both workers get some
    log = run_recipe(c, stages=["prompts", "answers", "states"], force=["answers"])
    assert log["states"]["workers"] == 2 and log["states"]["shards"] >= 2

    def first_turns(folder):
        return sorted((r for r in WorkDir.read_jsonl(folder / "answers.jsonl") if r["turn"] == 1), key=lambda r: r["id"])

    assert first_turns(work) == first_turns(config.work)
    ours, theirs = states_module.States(work / "states"), states_module.States(config.work / "states")
    by_tokens = {tuple(theirs.read(i, "tokens").tolist()): i for i in range(len(theirs.rows))}
    same = total = 0
    for i in range(len(ours.rows)):
        j = by_tokens[tuple(ours.read(i, "tokens").tolist())]
        torch.testing.assert_close(ours.read(i, "taps").float(), theirs.read(j, "taps").float(), rtol=2e-2, atol=5e-2)
        answer = slice(ours.rows[i].prompt_len, ours.rows[i].length - 1)
        same += int((ours.read(i, "topk_ids")[answer, 0] == theirs.read(j, "topk_ids")[answer, 0]).sum())
        total += ours.rows[i].length - 1 - ours.rows[i].prompt_len
    assert same >= 0.98 * total


def test_a_reduced_vocabulary_through_the_recipe(recipe, tmp_path):
    """draft_vocab 512 of 4096: the states stage picks the answers' most frequent tokens, the
    checkpoint ships lm_head and d2t, and the engine's greedy output is still the target's."""
    config, _ = recipe
    work = tmp_path / "work"
    shutil.copytree(config.work, work)
    c = config.replace(work=work, out=tmp_path / "out", draft=recipe_config.DraftShape(
        layers=1, block_size=4, window=32, markov_rank=8, draft_vocab=512))
    log = run_recipe(c, stages=["states", "train", "measure"], force=["states"])
    assert log["states"]["draft_vocab"] == 512 and log["states"]["vocab_coverage"]["train"] > 0.5
    tensors = load_file(c.out / "model.safetensors")
    assert tensors["lm_head.weight"].shape == (512, 256) and tensors["d2t"].shape == (512,)
    chosen = json.loads((work / "vocab.json").read_text())["ids"]
    assert sorted(set((torch.arange(512) + tensors["d2t"]).tolist())) == chosen
    assert json.loads((work / "measure.json").read_text())["batch1"]["greedy_identical"]


def test_benchmark_prompts_and_near_duplicates_are_dropped(tmp_path):
    bench = BenchmarkFilter(["What is photosynthesis?", "Give me three interesting facts about the Roman Empire.",
                             "Explain how a hash table works, with an example in Python."])
    assert bench.matches("what is Photosynthesis")  # the same words
    assert bench.matches("Give me three interesting facts about the Roman Empire!")
    assert bench.matches("Explain how a hash table works with a short example in Python.")  # near
    assert not bench.matches("Give me three interesting facts about volcanoes.")
    assert not bench.matches("What is a black hole?")
    # In the prompts stage: a benchmark file holding one of the topic prompts the seed draws.
    config = ci_config(tmp_path, self_written_prompts=0, stdlib_prompts=0, exclude=None)
    rows, _ = build_prompts(config, BenchmarkFilter([]))
    file = tmp_path / "bench.jsonl"
    file.write_text(json.dumps({"prompt": rows[0]["messages"][0]["content"], "output_tokens": 9}) + "\n")
    kept, counts = build_prompts(config.replace(exclude=file), BenchmarkFilter.from_file(file))
    assert counts["dropped"]["benchmark"] == 1
    assert rows[0]["messages"] not in [r["messages"] for r in kept]
    assert len(kept) == len(rows) - 1
    assert sum(r["split"] == "heldout" for r in kept) >= 1


def test_the_command_line_runs_the_recipe(recipe, tmp_path, capsys):
    config, log = recipe
    work = tmp_path / "work"
    shutil.copytree(config.work, work)
    shutil.copytree(config.out, tmp_path / "out")
    code = cli_main(["train-drafter", "--target", str(config.target), "--out", str(tmp_path / "out"), "--work",
                     str(work), "--preset", "ci"])
    assert code == 0 and capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert json.loads((work / "log.json").read_text())["stages"] == log  # all done: nothing ran
    assert cli_main(["train-drafter", "--out", str(tmp_path / "x"), "--stages", "nope"]) == 2
    assert "unknown stage" in capsys.readouterr().err
    assert set(STAGE_NAMES) >= set(RAN)

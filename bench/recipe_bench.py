"""The one recipe's cost at ViT-B width: a training step of configs/pretrain_multi_domain.yaml's
model, the recipe (stem [16] with peak pooling, max pooling, latent + local term: docs/recipe.md), against
the same model without them (linear patchify, mean pooling, latent term only), CPU, float32, batch 2
of 32 x 96 x 96 (288 tokens: the stem's share at 9,216 tokens, where attention grows
quadratically, is smaller than here, so this is an upper bound). Each round times both, one after
the other, in fresh processes with imports done and warm-up steps; the ratio is the median of
the rounds' ratios."""
from __future__ import annotations

import shutil
import statistics
from pathlib import Path

from bench.train_bench import _STEP_CODE, _make_cache, _run_json

PROD = "configs/pretrain_multi_domain.yaml"
AT_CPU_SIZE = ["data.input_shape=[32,96,96]", "global_batch=2", "precision=fp32", "device=cpu", "data.workers=0",
               "wandb.enabled=false"]
PLAIN = ["model.stem=[]", "model.stem_pool=none", "model.pool=mean", "loss.local=0.0"]  # plain V-JEPA: what vjepa2 computes


def run(workdir: Path, quick: bool = False):
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    cache = _make_cache(workdir)
    base = [f"data.cache={cache}", f"runs_dir={workdir / 'runs'}", *AT_CPU_SIZE]
    steps, rounds = (2, 1) if quick else (5, 3)
    times: dict[str, list[float]] = {"recipe": [], "plain": []}
    for _ in range(rounds):
        for name, extra in (("recipe", []), ("plain", PLAIN)):
            times[name].append(_run_json(_STEP_CODE.format(config=PROD, overrides=base + extra, steps=steps))["step_s"])
    shutil.rmtree(workdir, ignore_errors=True)
    ratios = [r / p for r, p in zip(times["recipe"], times["plain"])]
    res = {"recipe_step_s": [round(t, 3) for t in times["recipe"]], "plain_step_s": [round(t, 3) for t in times["plain"]],
           "ratio": round(statistics.median(ratios), 3), "rounds": rounds, "steps_per_round": steps}
    lines = ["## The one recipe at ViT-B width (CPU, float32, batch 2, 32 x 96 x 96 = 288 tokens)", "",
             "| model | step (s), per round |", "|---|---|",
             f"| as configured: stem [16] + peaks, max pooling, latent + local term | {res['recipe_step_s']} |",
             f"| plain V-JEPA: linear patchify, mean pooling, latent term | {res['plain_step_s']} |", "",
             f"Recipe / plain step time: {res['ratio']:.2f}x (median of {rounds} side-by-side rounds; an upper bound "
             "for 9,216 tokens)."]
    return res, lines

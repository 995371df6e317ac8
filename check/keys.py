"""What keys the learning check's kept results: each is made afresh when the code it runs changes (its
entry files' import closure), and reused otherwise."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

from octfm import config


# What each kept result is made by: its entry files, whose import closure (config.import_closure) keys it, so an
# edit to any file they import makes it afresh (config.source_digest) and an edit elsewhere keeps it
COHORT_CODE = ("ingest/synth.py",)
# `make pretrain`, and the cache builder: a run is named for its cache's path, not its contents (recipe_name)
PRETRAIN_CODE = ("train/pretrain.py", "cache/build.py")
# a fine-tuning run's folder (a supervised reference's too: its from-scratch run) sits under its pretraining run
# (keyed on PRETRAIN_CODE); its own training loop, head,
# participants, config defaults, the probes' fit (its fitted start, head_init: probe), the start features, the val
# score that picks its best epoch and the labelled data key its name too, through what evals/finetune.py imports
FINETUNE_CODE = ("evals/finetune.py",)
# files an entry imports that make none of its results, each with why (none today: `make plan`, train/plan.py,
# sits beside the trainer and no entry imports it, so an edit to it keeps the runs without an exclusion)
NOT_KEYED: dict[str, str] = {}


def keyed_files(code: Sequence[str]) -> list[str]:
    """The files whose contents key a result made by `code` (one of the *_CODE entries): every file
    they import, less NOT_KEYED."""
    return [f for f in config.import_closure(*code) if f not in NOT_KEYED]


def code_key(code: Sequence[str], length: int = 12) -> str:
    """The content key of keyed_files(code)."""
    return config.source_digest(*keyed_files(code), length=length)


def recipe_name(config_path: str, cache: str, overrides: Sequence[str], code: Sequence[str] = PRETRAIN_CODE) -> str:
    """A run name per recipe, cache and code, so a changed ARGS, SOURCE or trainer (the sources
    under `code`) trains afresh and an unchanged one resumes; an edit to the probes alone keeps
    the pretraining."""
    blob = "\n".join([Path(config_path).read_text(), cache, *overrides, code_key(code)])
    return "pretrain_" + hashlib.sha256(blob.encode()).hexdigest()[:8]


def finetune_tag(init: str, fraction: float, train_seed: int | None, seed: int) -> str:
    """A fine-tuning run's folder name under its pretraining run: init, fraction, the seed that picks
    its participants (a re-run with `--probe seed=N` draws others: a run is reused only for the very
    participants it trained on), training seed and the fine-tuning code (FINETUNE_CODE)."""
    return (f"{init}_{round(fraction * 100)}pct_s{seed}" + ("" if train_seed is None else f"_t{train_seed}") +
            "_" + code_key(FINETUNE_CODE, length=8))

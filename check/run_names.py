"""The names of the learning check's kept results (its pretraining runs, fine-tuning folders, jobs): each
name holds a key of the code that makes the result (its entry files' import closure), so an edit to that
code makes it afresh and an edit elsewhere reuses it."""
from __future__ import annotations

import hashlib
from decimal import Decimal
from pathlib import Path
from typing import Sequence

from octfm import config


# What each kept result is made by: its entry files, whose import closure (config.import_closure) keys it, so an
# edit to any file they import makes it afresh (config.source_digest) and an edit elsewhere keeps it
COHORT_CODE = ("ingest/synth.py",)
# `make pretrain`, and the cache builder: a run is named for its cache's path and contents (recipe_name)
PRETRAIN_CODE = ("train/pretrain.py", "cache/build.py")
# a fine-tuning run's folder (a supervised reference's too: its from-scratch run) sits under its pretraining run
# (keyed on PRETRAIN_CODE); its own training loop, head,
# participants, config defaults, the start features, the val
# score that picks its best epoch and the labelled data key its name too, through what evals/finetune.py imports
FINETUNE_CODE = ("evals/finetune.py",)
# files an entry imports that make none of its results, each with why (none today: `make plan`, train/plan.py,
# sits beside the trainer and no entry imports it, so an edit to it keeps the runs without an exclusion)
NOT_KEYED: dict[str, str] = {}


def keyed_files(code: Sequence[str]) -> list[str]:
    """The files whose contents key a result made by `code` (one of the *_CODE entries): every file
    they import, less NOT_KEYED."""
    return [f for f in config.import_closure(*code) if f not in NOT_KEYED]


def run_code_key(code: Sequence[str], length: int = 12) -> str:
    """The content key of keyed_files(code) (config.code_key, which the evaluation's kept results use too)."""
    return config.code_key(code, exclude=tuple(NOT_KEYED), length=length)


def cache_contents(cache: str) -> str:
    """A digest of what the cache holds: every ok volume's path and cache key (the key covers its source's
    size, version and hashes, the preprocessing and its code). A cohort regenerated in the same folder, or a
    SOURCE whose files changed, gives another digest although the cache's path is the same."""
    from manifests import paths

    try:
        table = paths.read_manifest_table(cache).select(["relpath", "status", "cache_key"]).to_pylist()
    except FileNotFoundError:  # not built (yet): named for its path alone
        return "no manifest"
    rows = sorted(f"{r['relpath']}\t{r['cache_key']}" for r in table if r["status"] == "ok")
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


def recipe_name(config_path: str, cache: str, overrides: Sequence[str], code: Sequence[str] = PRETRAIN_CODE) -> str:
    """A run name per recipe, cache (its path and contents) and code, so a changed ARGS, SOURCE, cohort or
    trainer (the sources under `code`) trains afresh and an unchanged one resumes; an edit to the probes alone
    keeps the pretraining."""
    blob = "\n".join([Path(config_path).read_text(), cache, cache_contents(cache), *overrides, run_code_key(code)])
    return "pretrain_" + hashlib.sha256(blob.encode()).hexdigest()[:8]


def percent(fraction: float) -> str:
    """A label fraction in percent, exactly (0.104: "10.4", 0.1: "10"; from its shortest repr, so two
    fractions never share one): the names made from fractions (jobs, run folders, rows) stay apart."""
    return format((Decimal(repr(float(fraction))) * 100).normalize(), "f")


def finetune_tag(init: str, fraction: float, train_seed: int | None, seed: int) -> str:
    """A fine-tuning run's folder name under its pretraining run: init, fraction, the seed that picks
    its participants (a re-run with `--probe seed=N` draws others: a run is reused only for the very
    participants it trained on), training seed and the fine-tuning code (FINETUNE_CODE)."""
    return (f"{init}_{percent(fraction)}pct_s{seed}" + ("" if train_seed is None else f"_t{train_seed}") +
            "_" + run_code_key(FINETUNE_CODE, length=8))

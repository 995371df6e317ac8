"""The learning check's cohorts: the generated ones and their cues, and the cache built from a cohort
(at 32 x 128 x 128, what both sizes of the check read)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from cache import build as cache_build
from cache.config import CacheConfig
from check.run_names import COHORT_CODE, run_code_key
from ingest import synth
from octfm import config


DEV_SEED = 16  # the development cohorts' generator seed; a confirmation run takes one never used (--seed)
COHORT = synth.SynthConfig(participants=1000, scale=4, seed=DEV_SEED, lesions=10.0, bad_files=False, unlabeled=0)


@dataclasses.dataclass(frozen=True)
class Cue:
    """One kind of class cue: the cohort that carries it (named, so cues sharing it share the
    cohort, cache and pretraining) and how probes split it (`splits`: the cohort's own;
    `scanners`: each scanner held out in turn, evals/subsets.py)."""
    cohort_name: str
    cohort: synth.SynthConfig
    protocol: str
    target: float  # pretrained minus random-init, binary task, with the paired interval above 0
    what: str


CUES = {
    "lesions": Cue("lesions", COHORT, "splits", 0.10, "macular foci and cysts, more of them with the class"),
    "layers": Cue("layers", dataclasses.replace(COHORT, lesions=0.0, layers=0.20), "splits", 0.10,
                  "a thicker inner nuclear layer over a macular patch, growing with the class"),
    "scanners": Cue("lesions", COHORT, "scanners", 0.05,
                    "the lesions cohort, probes trained on three scanners and tested on the fourth"),
}
# the grid stretch: the phantom draws its anatomy in coordinates relative to the volume, not in mm, so a
# fixed voxel size (configs/cache.yaml's `spacing`, for the release) would only zoom it (docs/data.md, "Resampling")
CACHE_ARGS = ["preprocess.target_shape=[32,128,128]", "preprocess.resample=grid"]
BINARY, MULTI = "diabetic", "study_group"


def eval_device(train_device: str) -> str:
    """Where the check's features and fine-tuning run: cuda when the pretraining does (or may,
    `auto`) and one is here; else the cpu."""
    import torch

    return "cuda" if train_device in ("cuda", "auto") and torch.cuda.is_available() else "cpu"


def cohort(root: Path, cfg: synth.SynthConfig) -> str:
    """The generated cohort, written once per generator config and generator code (a marker names both)."""
    participants = cfg.participants
    marker = root / "cohort.json"
    want = json.dumps({**dataclasses.asdict(cfg), "code": run_code_key(COHORT_CODE)}, sort_keys=True)
    if not (marker.exists() and marker.read_text() == want):
        counts = synth.generate(root, cfg, progress=True)
        print(f"learning-check: cohort of {participants} participants, {counts['good']} volumes in {root}")
        marker.write_text(want)
    else:
        print(f"learning-check: cohort in {root} reused")
    return str(root)


def build_cache(source: str, cache: Path) -> str:
    cfg = config.load(CacheConfig, "configs/cache.yaml", CACHE_ARGS)
    cache_build.build(source, str(cache), cfg, progress=True)
    return str(cache)

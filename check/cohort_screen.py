"""`python -m check.cohort_screen`: is a labelled cache's class cue local, and learnable by the
recipe's encoder? Label-aware measurements only, so a cohort can be qualified for the learning
check before any pretraining runs on it (docs/history/learning-check.md: the cohort's difficulty set by
label-aware screens, lesions at the scale of the tokens, three cues).

Three numbers, each a balanced accuracy on the binary `diabetic` task:
- global statistics (mean, std, percentiles and retinal thickness of each cached volume) in a logistic regression,
  5 folds over participants: must be at chance, or the cue is not local;
- a hand-made blob counter (lesions brighter or darker than their en-face neighbourhood) in the
  same regression: what a reader who knows where to look gets;
- a supervised reference: the config's encoder trained from scratch on the labels by `make
  finetune`'s loop (evals/finetune.py, configs/finetune.yaml's recipe over the screen's step
  budget, the last state kept), scored with its own head on centre crops of the train split
  (first 400) and of val.

`--plant AMP` adds a bright cube (+AMP grey levels, 8 x 16 x 16 voxels, at a random place) to
every positive training crop: a cue any encoder should learn, which tells "this encoder cannot
learn local cues here" from "this cohort's cue is too weak"; the plant keys the reference's run, so an
--out whose reference trained with another plant (or none) is refused, not reused. Writes <out>/screen.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from scipy import ndimage
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score
from sklearn.model_selection import GroupKFold, cross_val_predict
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from cache import store
from evals import backbone, finetune, probe
from evals.config import FinetuneConfig
from manifests.aireadi import TASKS
from octfm import cli, config, fsio
from train import data, runtime
from train.config import TrainConfig
from train.model import Encoder

TASK = "diabetic"
QUALIFY = {"supervised_val": 0.65, "global_below": 0.58}  # the screens' bar (docs/history/learning-check.md)


def retinal_thickness(vol: np.ndarray) -> float:
    """Rows between the first and the last bright voxel of each A-scan (every 4th column,
    lightly smoothed; bright: the volume's top quartile), median over A-scans: total retinal
    thickness, which a layers cue must not carry."""
    s = ndimage.gaussian_filter(vol.astype(np.float32), (1, 2, 2))[:, :, ::4]
    bright = s > np.percentile(s, 75)
    seen = bright.any(axis=1)                                      # [frames, columns]
    first = bright.argmax(axis=1)
    last = bright.shape[1] - 1 - bright[:, ::-1].argmax(axis=1)
    return float(np.median((last - first)[seen])) if seen.any() else 0.0


def global_statistics(vol: np.ndarray) -> list[float]:
    """Per-volume intensity statistics and total retinal thickness: what a cue that is not local shows up in."""
    return [vol.mean(), vol.std(), *np.percentile(vol, [1, 5, 25, 50, 75, 95, 99]), retinal_thickness(vol)]


def lesion_counts(vol: np.ndarray) -> list[float]:
    """Blobs brighter / darker than their en-face neighbourhood inside the retina's mid-grey
    band of the central three quarters of rows and columns: smoothing across frames and
    columns only removes the layers (smooth there) and keeps local lesions. Its widths and
    thresholds were set on 32 x 128 x 128 caches (the learning check's)."""
    h, w = vol.shape[1:]
    c = vol[:, h // 8:h - h // 8, w // 8:w - w // 8]
    background = ndimage.gaussian_filter(c, (4, 0.7, 10))
    d = ndimage.gaussian_filter(c, (1, 1, 1.5)) - background
    band = (background > 90) & (background < 200)
    out = []
    for mask in (d > 25, d > 30, d > 35, d < -30, d < -35, d < -40, d < -45):
        lab, _ = ndimage.label(mask & band)
        out.append(np.log1p((np.bincount(lab.ravel())[1:] >= 6).sum()))
    return out


def held_out_score(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> float:
    """Balanced accuracy of predictions for held-out participants (5 folds over participants,
    so every volume is scored by a model that never saw its participant)."""
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, class_weight="balanced"))
    pred = cross_val_predict(model, x, y, groups=groups, cv=GroupKFold(5))
    return float(balanced_accuracy_score(y, pred))


def statistics_scores(cache: str) -> dict:
    """Global statistics and blob counter, held out over participants, on every ok labelled row
    (one volume in memory at a time: a 1,000-participant cache is 4.7 GB as float32)."""
    rows = data.select_rows(cache, probe.PROBED_SPLITS, None, labelled=True)
    glob, counts = [], []
    for r in rows:
        vol = store.read_volume(cache, r["volume"]).astype(np.float32)
        glob.append(global_statistics(vol))
        counts.append(lesion_counts(vol))
    y = np.array([TASKS[TASK]["map"](r["label"]) for r in rows])
    groups = np.array([r["participant_id"] for r in rows])
    return {"global": held_out_score(np.array(glob), y, groups), "counter": held_out_score(np.array(counts), y, groups),
            "volumes": len(rows), "participants": len(set(groups)), "devices": len({r["device"] for r in rows})}


CUBE = (8, 16, 16)


def plant_cube(x: torch.Tensor, amp: int, seed) -> torch.Tensor:
    """uint8 [1, D, H, W] with +amp grey levels over a CUBE at a place drawn from `seed`."""
    out = x.int()
    r = np.random.default_rng(seed)
    f, a, b = (int(r.integers(0, max(1, n - k + 1))) for n, k in zip(out.shape[1:], CUBE))
    out[0, f:f + CUBE[0], a:a + CUBE[1], b:b + CUBE[2]] += amp
    return out.clamp_(0, 255).to(torch.uint8)


class Planted(finetune.Labelled):
    """Labelled crops with a bright cube in every positive one (placed from the key, so runs repeat)."""

    def __init__(self, ds, y, amp: int):
        super().__init__(ds, y)
        self.amp = amp

    def __getitem__(self, key) -> dict:
        item = super().__getitem__(key)
        if item["y"] == 1:
            item["x"] = plant_cube(item["x"], self.amp, [key[0], key[1]])
        return item


def train_reference(cfg: TrainConfig, out: Path, steps: int, plant: int, progress: bool) -> finetune.Finetuner:
    """The config's encoder from scratch, trained `steps` optimizer steps on every labelled train row
    (with `plant`, positive crops carry the cube), scored on val once, at the end, so the state kept
    is the last one."""
    ft_cfg = config.load(FinetuneConfig, "configs/finetune.yaml", [
        "init=random", f"task={TASK}", f"out={out}", f"cache={cfg.data.cache}", f"device={cfg.device}",
        f"precision={cfg.precision}", "epochs=100000", f"max_steps={steps}", f"val_every={steps}", "patience=0",
        "workers=0", "log_every=50"])
    rt = runtime.setup(ft_cfg.device, ft_cfg.precision)
    torch.manual_seed(ft_cfg.seed)
    enc = Encoder(cfg.model, cfg.data.input_shape)
    ident = {"init": "random", "seed": ft_cfg.seed, "config": config.to_dict(cfg.model)}
    wrap = functools.partial(Planted, amp=plant) if plant else None
    ft = finetune.Finetuner(ft_cfg, rt, backbone=backbone.Backbone(enc, cfg, ident), dataset=wrap,
                            dataset_key={"plant": plant} if plant else None)  # a run without the cube is not this one
    ft.run(progress=progress)
    return ft


def own_head_scores(ft: finetune.Finetuner, cap: int = 400, plant: int = 0) -> dict:
    """The reference's own head on centre crops: train (first `cap`) and val (with `plant`, every
    positive volume carries the cube too, so the score reads the cue)."""
    out = {}
    for split, n in (("train", cap), ("val", None)):
        mask = ft.split == split
        if n is not None:
            mask &= np.cumsum(mask) <= n
        y = ft.y[mask]

        def planted(x, start):  # seeds apart from the training crops' (epoch, index) keys
            return torch.stack([plant_cube(v, plant, [2 ** 31, start + j]) if y[start + j] == 1 else v
                                for j, v in enumerate(x)])

        pred = ft.predict(mask, change=planted if plant else None).argmax(1)
        out[split] = float(balanced_accuracy_score(y, pred))
    return out


def screen(cache: str, out: Path, config_path: str, overrides: Sequence[str], steps: int | None = None,
           plant: int = 0, stats: bool = True, progress: bool = True) -> dict:
    cfg = config.load(TrainConfig, config_path, [*overrides, f"data.cache={cache}"])
    res: dict = {"cache": cache, "config": config_path, "overrides": list(overrides), "plant": plant}
    if stats:
        t0 = time.perf_counter()
        res["statistics"] = statistics_scores(cache)
        res["statistics_s"] = round(time.perf_counter() - t0, 1)
    steps = steps or cfg.max_steps
    t0 = time.perf_counter()
    ft = train_reference(cfg, out, steps, plant, progress)
    res["supervised"] = {"steps": steps, "wall_s": round(time.perf_counter() - t0, 1), **own_head_scores(ft, plant=plant)}
    res["verdict"] = verdict(res)
    out.mkdir(parents=True, exist_ok=True)
    fsio.atomic_write_bytes(str(out / "screen.json"), json.dumps(res, indent=2).encode())
    return res


def verdict(res: dict) -> str:
    val = res["supervised"]["val"]
    glob = res.get("statistics", {}).get("global")
    ok = val >= QUALIFY["supervised_val"] and (glob is None or glob < QUALIFY["global_below"])
    return (f"cohort-screen: {'QUALIFIES' if ok else 'does not qualify'} (supervised val {val:.3f}, "
            f"needs >= {QUALIFY['supervised_val']}; global statistics "
            f"{'not measured' if glob is None else f'{glob:.3f}'}, needs < {QUALIFY['global_below']})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m check.cohort_screen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, help="a labelled cache (the counter was tuned on 32 x 128 x 128)")
    ap.add_argument("--out", required=True, help="where the supervised checkpoint and screen.json go")
    ap.add_argument("--config", default="configs/pretrain_check.yaml")
    ap.add_argument("--steps", type=int, default=None, help="supervised steps (default: the config's max_steps)")
    ap.add_argument("--plant", type=int, default=0, metavar="AMP", help="plant a bright cube in positive crops")
    ap.add_argument("--no-stats", action="store_true", help="skip the global-statistics and counter scores")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    a = ap.parse_args(argv)
    if not (Path(a.cache) / "manifest.parquet").exists():
        raise cli.UsageError(f"--cache {a.cache}: no manifest.parquet (build it with `make cache`)")
    r = screen(a.cache, Path(a.out), a.config, a.overrides, a.steps, a.plant, stats=not a.no_stats)
    print(json.dumps({k: v for k, v in r.items() if k != "verdict"}, indent=2))
    print(r["verdict"])
    return 0


if __name__ == "__main__":
    cli.run(main)

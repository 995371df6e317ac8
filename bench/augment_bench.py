"""The training crop's cost at production size: the host-side transforms
of one sample (random crop and flip, and with data.scale [0.8, 1.0] the random box resized back
to 64 x 384 x 384, trilinear) on an in-memory uint8 volume of the production shape, so reading
the volume (the same for both) is left out. Alternating rounds, median per sample; per batch it
is spread over the loader's workers."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from bench import card_batch
from octfm import config
from train import data, masks
from train.config import TrainConfig

PROD = "configs/pretrain_multi_domain.yaml"


def _pipeline(scale):
    cfg = config.load(TrainConfig, PROD, [f"data.scale=[{scale[0]},{scale[1]}]"])
    grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
    ds = data.CacheDataset([], cfg.data, cfg.mask, grid, masks.calibrate(grid, cfg.mask), 0)
    return ds.transforms(), cfg


def run(workdir: Path, quick: bool = False):
    rng = np.random.default_rng(0)
    pipes = {"crop + flip": _pipeline((1.0, 1.0)), "data.scale [0.8, 1.0]": _pipeline((0.8, 1.0))}
    cfg = next(iter(pipes.values()))[1]
    vol = rng.integers(0, 256, (1, *cfg.data.input_shape), dtype=np.uint8)
    rounds, reps = (1, 2) if quick else (5, 5)
    times: dict[str, list[float]] = {k: [] for k in pipes}
    for t, _ in pipes.values():
        t(vol)  # warm-up
    for r in range(rounds):
        for name, (t, _) in pipes.items():
            t0 = time.perf_counter()
            for i in range(reps):
                t.set_random_state(seed=r * reps + i)
                t(vol)
            times[name].append((time.perf_counter() - t0) / reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    workers = data.loader_workers(cfg.data.workers)  # the config's null: from this host's cores, as training takes it
    res = {"ms_per_sample": {k: round(1000 * v, 1) for k, v in med.items()}, "batch_size": card_batch(cfg),
           "workers": workers, "shape": list(cfg.data.input_shape), "rounds": rounds}
    extra = med["data.scale [0.8, 1.0]"] - med["crop + flip"]
    res["extra_ms_per_batch_per_worker"] = round(1000 * extra * card_batch(cfg) / workers, 1)
    lines = [f"## Training crop at production size ({' x '.join(map(str, cfg.data.input_shape))}, one sample, host side)",
             "", "| transforms | ms per sample (median) |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in res["ms_per_sample"].items()]
    lines += ["", f"data.scale adds {1000 * extra:.0f} ms per sample: {res['extra_ms_per_batch_per_worker']} ms per "
              f"batch of {card_batch(cfg)} per worker with data.workers={workers} (it overlaps the step)."]
    return res, lines

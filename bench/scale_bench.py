"""The physical scale per scan protocol under the two resample modes (`make bench --only scale`).

For each raster protocol of the release (manifests/protocols.py) at its native shape, with its
published field across frames and along columns and its device's depth spacing (ingest/synth.py:
the values the synthetic headers carry; real headers decide in a real cache):

- the stored voxel size (um) under `grid` (stretched onto the target shape) and under `spacing`
  (configs/cache.yaml's spacing_mm), and, under `spacing`, the fraction of the field kept per axis
  and the fraction of the stored volume that is padding;
- the cost per volume of the two modes (window + resample, one thread, as a build worker runs it),
  medians of runs after a warm-up, side by side in one process.

docs/data.md ("Resampling") reads the choice of configs/cache.yaml's mode from these numbers.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench import verdict
from cache.config import CacheConfig
from ingest import phantom, synth
from ingest import preprocess as prep
from manifests.protocols import PROTOCOLS, RASTER
from octfm import config

CACHE_CONFIG = "configs/cache.yaml"


def protocol_spacing(name: str) -> tuple[tuple[int, int, int], tuple[float, float, float]]:
    p = PROTOCOLS[name]
    return p.shapes[0], synth.native_spacing(synth.DEVICES[p.device], p)


def geometry_row(name: str, cfg: prep.PreprocessConfig) -> dict:
    """Voxel sizes, field kept and padding for one protocol: arithmetic on the plans, no pixels."""
    shape, spacing = protocol_spacing(name)
    target = cfg.target_shape
    field = [n * s for n, s in zip(shape, spacing)]
    grid_um = [1000 * f / t for f, t in zip(field, target)]
    plans, out_spacing, crop_pad = prep.axis_plans(shape, spacing, config.from_dict(
        prep.PreprocessConfig, {**config.to_dict(cfg), "resample": "spacing"}))
    resampled = [t - cp for t, cp in zip(target, crop_pad)]
    kept = [min(1.0, t / r) for t, r in zip(target, resampled)]
    filled = np.prod([min(t, r) for t, r in zip(target, resampled)]) / np.prod(target)
    return {"protocol": name, "native_shape": list(shape), "field_mm": [round(f, 2) for f in field],
            "grid_um": [round(v, 1) for v in grid_um], "spacing_um": [round(1000 * v, 1) for v in out_spacing],
            "field_kept": [round(k, 3) for k in kept], "padding": round(1 - float(filled), 3), "crop_pad": crop_pad}


def _cost(vol: np.ndarray, spacing, cfg: prep.PreprocessConfig, repeat: int) -> float:
    prep.preprocess(vol, cfg, spacing=spacing)  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        prep.preprocess(vol, cfg, spacing=spacing)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(workdir: Path, quick: bool = False):
    import torch

    torch.set_num_threads(1)  # as a build worker runs
    base = config.load(CacheConfig, CACHE_CONFIG).preprocess
    grid = config.from_dict(prep.PreprocessConfig, {**config.to_dict(base), "resample": "grid"})
    spacing = config.from_dict(prep.PreprocessConfig, {**config.to_dict(base), "resample": "spacing"})
    repeat = 1 if quick else 3
    load = os.getloadavg()[0]
    rows = []
    for name, p in PROTOCOLS.items():
        if p.pattern != RASTER:
            continue
        row = geometry_row(name, spacing)
        shape, native = protocol_spacing(name)
        if quick:
            shape = tuple(max(8, n // 8) for n in shape)
            native = tuple(s * 8 for s in native)
        vol = phantom.make_volume(shape, np.random.default_rng(0), "R")
        row["grid_s"] = round(_cost(vol, native, grid, repeat), 3)
        row["spacing_s"] = round(_cost(vol, native, spacing, repeat), 3)
        rows.append(row)
        del vol
    res = {"target_shape": list(base.target_shape), "spacing_mm": list(spacing.spacing_mm), "repeats": repeat,
           "load_average": load, "protocols": rows, "configured": base.resample}
    return res, markdown(res)


def spread(rows: list[dict], key: str, axis: int) -> tuple[float, float]:
    vals = [r[key][axis] for r in rows]
    return min(vals), max(vals)


def markdown(res: dict) -> list[str]:
    rows = res["protocols"]
    um = lambda v: " x ".join(f"{x:g}" for x in v)  # noqa: E731
    lines = [
        "## Physical scale per protocol",
        f"Target shape {tuple(res['target_shape'])}; `spacing` at {tuple(res['spacing_mm'])} mm; configs/cache.yaml "
        f"chooses `{res['configured']}`. Voxel sizes in um (frames x depth x columns); cost per volume: window and "
        f"resample at the native shape, one thread, median of {res['repeats']} after a warm-up. Load average at the "
        f"start: {res['load_average']:.1f} on {len(os.sched_getaffinity(0))} CPUs.",
        "",
        "| protocol | native shape | field mm | grid: voxel um | spacing: voxel um | spacing: field kept | "
        "spacing: padding | grid s | spacing s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['protocol']} | {'x'.join(map(str, r['native_shape']))} | {um(r['field_mm'])} | "
                     f"{um(r['grid_um'])} | {um(r['spacing_um'])} | {um(r['field_kept'])} | {r['padding']:.0%} | "
                     f"{r['grid_s']:.2f} | {r['spacing_s']:.2f} |")
    lo_g, hi_g = spread(rows, "grid_um", 2)
    lo_d, hi_d = spread(rows, "grid_um", 1)
    ratio = statistics.median(r["spacing_s"] / r["grid_s"] for r in rows)
    lines += ["", f"Lateral voxel under grid: {lo_g:g}-{hi_g:g} um ({hi_g / lo_g:.1f}x apart); depth {lo_d:g}-{hi_d:g} um. "
              f"Under spacing every protocol's voxel is the same. Cost of spacing over grid: median {ratio:.2f}x per "
              "volume.",
              f"Verdict: {verdict(ratio <= 1.25)}: resampling to a fixed voxel size costs no more than the grid stretch "
              "(target: at most 1.25x per volume)."]
    return lines

"""Pretraining benchmarks (pretraining issue): step time and tokens/s for the smoke config
and a ViT-S class config on CPU, peak memory, loader volumes/s against what a step consumes,
and the data-wait fraction of a real smoke run with 2 loader workers."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

SMOKE = "configs/pretrain_smoke.yaml"
VITS = ["model.dim=384", "model.depth=6", "model.heads=6", "model.pred_dim=192", "model.pred_depth=4",
        "model.pred_heads=6", "data.input_shape=[32,96,96]", "batch_size=2", "precision=fp32"]

_STEP_CODE = """
import json, sys, time, torch
from octfm import config
from train import pretrain, runtime
from train.config import TrainConfig
def hwm():
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
cfg = config.load(TrainConfig, {smoke!r}, {overrides!r})
tr = pretrain.Trainer(cfg, runtime.setup("cpu", cfg.precision))
_, dl = tr.loader(tr.rows, 0, augment=True, shuffle=True, seed=0)
it = iter(dl)
batches = [tr.rt.to_device(next(it)) for _ in range(4)]
tr.lr.fill_(1e-4); tr.momentum.fill_(0.99)
for i in range(3):
    tr.update([batches[i % 4]], tr.model)
n = {steps}
t = time.perf_counter()
for i in range(n):
    tr.update([batches[i % 4]], tr.model)
dt = (time.perf_counter() - t) / n
print(json.dumps({{"step_s": dt, "tokens": tr.grid.tokens, "batch": cfg.batch_size, "peak_mb": hwm() / 1024,
                  "params_m": sum(p.numel() for p in tr.model.parameters()) / 1e6}}))
"""

_LOADER_CODE = """
import json, time
from octfm import config
from train import pretrain, runtime
from train.config import TrainConfig
cfg = config.load(TrainConfig, {smoke!r}, {overrides!r})
tr = pretrain.Trainer(cfg, runtime.setup("cpu", cfg.precision))
_, dl = tr.loader(tr.rows, 0, augment=True, shuffle=True, seed=0)
it = iter(dl)
for _ in range(4):
    next(it)
n = 30
t = time.perf_counter()
for _ in range(n):
    next(it)
dt = time.perf_counter() - t
print(json.dumps({{"volumes_per_s": n * cfg.batch_size / dt, "workers": cfg.data.workers}}))
"""


def _run_json(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _make_cache(workdir: Path) -> Path:
    from cache import build
    from cache.config import CacheConfig
    from ingest import synth
    from octfm import config

    src = workdir / "dataset"
    synth.generate(src, synth.SynthConfig(participants=16, scale=8, seed=0, bad_files=False))
    cache = workdir / "cache"
    build.build(str(src), str(cache), config.from_dict(CacheConfig, {}), progress=False)
    return cache


def run(workdir: Path, quick: bool = False):
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    cache = _make_cache(workdir)
    base = [f"data.cache={cache}", f"runs_dir={workdir / 'runs'}"]
    steps = 5 if quick else 20
    res: dict = {}
    for name, extra in (("smoke", ["data.workers=0"]), ("vit_s", VITS + ["data.workers=0"])):
        r = _run_json(_STEP_CODE.format(smoke=SMOKE, overrides=base + extra, steps=steps))
        r["samples_per_s"] = r["batch"] / r["step_s"]
        r["tokens_per_s"] = r["samples_per_s"] * r["tokens"]
        res[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
    loader = _run_json(_LOADER_CODE.format(smoke=SMOKE, overrides=base + ["data.workers=2"]))
    res["loader_2_workers_volumes_per_s"] = round(loader["volumes_per_s"], 1)
    res["smoke_step_consumes_volumes_per_s"] = round(res["smoke"]["samples_per_s"], 1)

    # a real smoke run with 2 workers: the trainer's own data_wait_frac, after the first interval
    max_steps = 40 if quick else 120
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "train.pretrain", "--config", SMOKE, "--no-progress", *base,
                        "name=bench_smoke", f"max_steps={max_steps}", "log_every=20", "val_every=0",
                        f"ckpt_every={max_steps}", "data.workers=2"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    res["smoke_run_s"] = round(time.perf_counter() - t, 1)
    recs = [json.loads(x) for x in (workdir / "runs" / "bench_smoke" / "metrics.jsonl").read_text().splitlines()]
    waits = [x["data_wait_frac"] for x in recs if x["split"] == "train"][1:]
    res["smoke_data_wait_frac"] = round(sum(waits) / len(waits), 4)
    res["smoke_loss_first_last"] = [round(recs[0]["loss"], 4), round(recs[-1]["loss"], 4)]
    shutil.rmtree(workdir, ignore_errors=True)

    s, v = res["smoke"], res["vit_s"]
    ok = res["smoke_data_wait_frac"] < 0.05
    lines = [
        "## Pretraining (pretraining issue), CPU, float32",
        "",
        "| config | params | tokens/sample | batch | step | samples/s | tokens/s | peak RSS |",
        "|---|---|---|---|---|---|---|---|",
        f"| smoke (dim 96, depth 3; 32x96x96) | {s['params_m']:.2f} M | {s['tokens']} | {s['batch']} | "
        f"{s['step_s'] * 1000:.0f} ms | {s['samples_per_s']:.1f} | {s['tokens_per_s']:.0f} | {s['peak_mb']:.0f} MB |",
        f"| ViT-S class (dim 384, depth 6; pred 192x4; 32x96x96) | {v['params_m']:.2f} M | {v['tokens']} | "
        f"{v['batch']} | {v['step_s'] * 1000:.0f} ms | {v['samples_per_s']:.1f} | {v['tokens_per_s']:.0f} | "
        f"{v['peak_mb']:.0f} MB |",
        "",
        f"Data loader, 2 spawn/forkserver workers: {res['loader_2_workers_volumes_per_s']} volumes/s; the smoke step "
        f"consumes {res['smoke_step_consumes_volumes_per_s']} volumes/s.",
        f"Smoke run with 2 workers ({max_steps} steps, {res['smoke_run_s']} s): data wait "
        f"{res['smoke_data_wait_frac'] * 100:.1f}% of step time (target < 5%: {'met' if ok else 'NOT met'}); "
        f"loss {res['smoke_loss_first_last'][0]} -> {res['smoke_loss_first_last'][1]}.",
    ]
    return res, lines

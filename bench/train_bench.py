"""Pretraining benchmarks: step time, tokens/s, model FLOPs per step (forward and backward,
counted by torch.utils.flop_counter on one step), achieved FLOP/s and peak memory for the smoke,
a ViT-S class, the learning check's and the ViT-B config on CPU (so MFU on an accelerator is
the FLOPs over its step time over its peak); loader volumes/s against what a step consumes, and
the data-wait fraction of a real smoke run with 2 loader workers."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import verdict

SMOKE = "configs/pretrain_smoke.yaml"
VITS = ["model.dim=384", "model.depth=6", "model.heads=6", "model.pred_dim=192", "model.pred_depth=4",
        "model.pred_heads=6", "data.input_shape=[32,96,96]", "global_batch=2", "precision=fp32"]
CPU = ["device=cpu", "precision=fp32", "data.workers=0", "wandb.enabled=false"]
# name, config, overrides, timed steps (full, quick): ViT-B at batch 1 (9,216 tokens a volume; its FLOPs
# scale with the batch), a single timed step: on a CPU it is for the FLOP count and memory, not speed
CONFIGS = [("smoke", SMOKE, [], (20, 5)), ("vit_s", SMOKE, VITS, (20, 5)),
           ("check", "configs/pretrain_check.yaml", [], (20, 5)),
           ("vit_b", "configs/pretrain_multi_domain.yaml", ["global_batch=1"], (2, 1))]

_STEP_CODE = """
import json, sys, time, torch
from torch.utils.flop_counter import FlopCounterMode
from octfm import config
from train import pretrain, runtime
from train.config import TrainConfig
def hwm():
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
cfg = config.load(TrainConfig, {config!r}, {overrides!r})
tr = pretrain.Trainer(cfg, runtime.setup("cpu", cfg.precision))
_, dl = tr.train_loader(0)
it = iter(dl)
n = {steps}
batches = [tr.rt.to_device(next(it)) for _ in range(min(4, n + 1))]
tr.lr.fill_(1e-4); tr.momentum.fill_(0.99)
with FlopCounterMode(display=False) as fc:  # the first step, warm-up too: matmuls, convolutions, attention
    tr.update([batches[0]], tr.model)
for i in range(min(2, n - 1)):  # the counted step warmed up too
    tr.update([batches[i % len(batches)]], tr.model)
t = time.perf_counter()
for i in range(n):
    tr.update([batches[i % len(batches)]], tr.model)
dt = (time.perf_counter() - t) / n
ctx = [int(m.shape[1]) for k, m in batches[0].items() if k.startswith("ctx_")]
print(json.dumps({{"step_s": dt, "tokens": tr.grid.tokens, "context_tokens": ctx, "batch": cfg.global_batch,
                  "peak_mb": hwm() / 1024, "flops_per_step": fc.get_total_flops(),
                  "params_m": sum(p.numel() for p in tr.model.parameters()) / 1e6}}))
"""

_LOADER_CODE = """
import json, time
from octfm import config
from train import pretrain, runtime
from train.config import TrainConfig
cfg = config.load(TrainConfig, {config!r}, {overrides!r})
tr = pretrain.Trainer(cfg, runtime.setup("cpu", cfg.precision))
_, dl = tr.train_loader(0)
it = iter(dl)
for _ in range(4):
    next(it)
n = 30
t = time.perf_counter()
for _ in range(n):
    next(it)
dt = time.perf_counter() - t
print(json.dumps({{"volumes_per_s": n * cfg.global_batch / dt, "workers": cfg.data.workers}}))
"""


LABELS = {"smoke": "smoke (dim 96, depth 3; 32x96x96)", "vit_s": "ViT-S class (dim 384, depth 6; pred 192x4; 32x96x96)",
          "check": "learning check (configs/pretrain_check.yaml; 32x96x96)",
          "vit_b": "ViT-B (configs/pretrain_multi_domain.yaml at batch 1; 64x384x384)"}


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
    res: dict = {}
    for name, path, extra, steps in CONFIGS:
        r = _run_json(_STEP_CODE.format(config=path, overrides=base + CPU + extra, steps=steps[quick]))
        r["samples_per_s"] = r["batch"] / r["step_s"]
        r["tokens_per_s"] = r["samples_per_s"] * r["tokens"]
        r["achieved_flops_per_s"] = r["flops_per_step"] / r["step_s"]
        res[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
    loader = _run_json(_LOADER_CODE.format(config=SMOKE, overrides=base + ["data.workers=2"]))
    res["loader_2_workers_volumes_per_s"] = round(loader["volumes_per_s"], 1)
    res["smoke_step_consumes_volumes_per_s"] = round(res["smoke"]["samples_per_s"], 1)

    # a real smoke run with 2 workers: the trainer's own data_wait_frac, after the first interval
    max_steps = 40 if quick else 120
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "train.pretrain", "--config", SMOKE, "--no-progress", *base,
                        "name=bench_smoke", f"max_steps={max_steps}", "log_every=20", "val_every=0", "eval_every=0",
                        f"ckpt_every={max_steps}", "data.workers=2"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    res["smoke_run_s"] = round(time.perf_counter() - t, 1)
    recs = [json.loads(x) for x in (workdir / "runs" / "bench_smoke" / "metrics.jsonl").read_text().splitlines()]
    recs = [x for x in recs if x.get("split") == "train"]  # the training intervals only
    waits = [x["data_wait_frac"] for x in recs][1:]
    res["smoke_data_wait_frac"] = round(sum(waits) / len(waits), 4)
    res["smoke_loss_first_last"] = [round(recs[0]["loss"], 4), round(recs[-1]["loss"], 4)]
    shutil.rmtree(workdir, ignore_errors=True)

    ok = res["smoke_data_wait_frac"] < 0.05
    import torch

    res["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    lines = [
        f"## Pretraining, CPU ({res['cpu_capability']}, {torch.get_num_threads()} threads), float32",
        "",
        "| config | params | tokens/sample (context per mask set) | batch | step | samples/s | tokens/s | "
        "model GFLOP/step (fwd+bwd) | achieved GFLOP/s | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {LABELS[name]} | {r['params_m']:.2f} M | {r['tokens']} ({', '.join(map(str, r['context_tokens']))}) | "
          f"{r['batch']} | {r['step_s'] * 1000:.0f} ms | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
          f"{r['flops_per_step'] / 1e9:.1f} | {r['achieved_flops_per_s'] / 1e9:.1f} | {r['peak_mb']:.0f} MB |"
          for name, r in ((n, res[n]) for n, *_ in CONFIGS)),
        "",
        "MFU on an accelerator: GFLOP/step (x the batch over the batch here, for ViT-B) / its step time / its peak.",
        "",
        f"Data loader, 2 spawn/forkserver workers: {res['loader_2_workers_volumes_per_s']} volumes/s; the smoke step "
        f"consumes {res['smoke_step_consumes_volumes_per_s']} volumes/s.",
        f"Smoke run with 2 workers ({max_steps} steps, {res['smoke_run_s']} s): data wait "
        f"{res['smoke_data_wait_frac'] * 100:.1f}% of step time; "
        f"loss {res['smoke_loss_first_last'][0]} -> {res['smoke_loss_first_last'][1]}.",
        "",
        f"Verdict: the smoke run waits {res['smoke_data_wait_frac'] * 100:.1f}% of its step time for data "
        f"(target < 5%): {verdict(ok)}.",
    ]
    return res, lines

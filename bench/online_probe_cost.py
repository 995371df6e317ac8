"""What the update guard and the online probe cost, as fractions of a training step, on CPU.

    python -m bench.online_probe_cost --cache <cache> [--vitb] [key=value ...]

Step time: Trainer.update on real batches (the guarded step included). Guard: guarded_step
(fused AdamW's found_inf on CPU) and XLA's path (copy and select, timed here on CPU) against a bare
opt.step() on the same gradients. Probe: one
OnlineProbe call (encode max_train + max_val rows, score), as a fraction of eval_every steps.
"""
from __future__ import annotations

import argparse
import json
import time

from octfm import config
from train import online_probe, pretrain, runtime
from train.config import TrainConfig
from train.step import guarded_step

VITB = ["model.dim=768", "model.depth=12", "model.heads=12", "model.pred_dim=384", "model.pred_depth=6",
        "model.pred_heads=12"]


def timed(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def measure(cfg: TrainConfig, steps: int) -> dict:
    tr = pretrain.Trainer(cfg, runtime.setup("cpu", cfg.precision))
    _, dl = tr.loader(tr.rows, 0, augment=True, shuffle=True, seed=0)
    batch = next(iter(dl))
    tr.lr.fill_(1e-4)
    tr.update([batch], tr.model)  # warm up, creates the optimizer state
    step_s = timed(lambda: tr.update([batch], tr.model), steps)

    def grads_then(fn):
        for p in tr.model.parameters():
            p.grad = p.detach() * 1e-3
        fn()

    ok = tr.guard.loss_mean.new_ones((), dtype=bool)
    plain_s = timed(lambda: grads_then(tr.opt.step), steps)
    guarded_s = timed(lambda: grads_then(lambda: guarded_step(tr.opt, ok)), steps)
    select_s = timed(lambda: grads_then(lambda: guarded_step(tr.opt, ok, "select")), steps)
    probe = online_probe.OnlineProbe(cfg, tr.rt.device)
    probe(tr.target, 0)  # warm up (first reads)
    rec = probe(tr.target, 0)
    every = cfg.eval_every or 1000
    return {"params_m": round(sum(p.numel() for p in tr.model.parameters()) / 1e6, 2), "tokens": tr.grid.tokens,
            "batch": cfg.batch_size, "step_s": round(step_s, 4), "opt_step_s": round(plain_s, 4),
            "guarded_step_s": round(guarded_s, 4), "guard_overhead_frac_of_step": round((guarded_s - plain_s) / step_s, 4),
            "select_step_s": round(select_s, 4),           # the accelerators' copy-and-select path, timed on CPU
            "select_overhead_frac_of_step": round((select_s - plain_s) / step_s, 4),
            "probe_rows": rec["train_rows"] + rec["val_rows"], "probe_s": rec["seconds"],
            "probe_s_per_row_over_step_s_per_sample": round(rec["seconds"] / (rec["train_rows"] + rec["val_rows"])
                                                           / (step_s / cfg.batch_size), 3),
            "eval_every": every, "probe_frac_of_training": round(rec["seconds"] / (every * step_s), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--vitb", action="store_true", help="ViT-B widths (configs/pretrain_single_domain.yaml)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    over = [f"data.cache={a.cache}", "data.workers=0", "precision=fp32", "device=cpu", *(VITB if a.vitb else []),
            *a.overrides]
    cfg = config.load(TrainConfig, "configs/pretrain_smoke.yaml", over)
    print(json.dumps({"config": "vitb" if a.vitb else "smoke", "overrides": a.overrides, **measure(cfg, a.steps)}))


if __name__ == "__main__":
    main()

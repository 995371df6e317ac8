"""Drive Trainer.update step by step and inject loss spikes on one process, by the student's
loss multiplied by a device scalar there (`spiked`); used by the update-guard tests on DDP
(under torchrun) and on XLA. Writes <out>/rank<r>.pt: the state (model, target, optimizer) after
every step, each step's skip count, and on XLA the compile count after every step.

    python tests/guard_driver.py --out DIR --steps 6 --spike 3:1e4 --spike-rank 1 -- key=value ...
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from octfm import config
from train import pretrain, runtime
from train.config import TrainConfig
from train.metrics import xla_compiles
from train.schedule import set_scalar


def spiked(net, scale: torch.Tensor):
    """`net` as Trainer.update calls it, its loss multiplied by `scale`: a device scalar written per
    step with set_scalar (data, not a graph constant: XLA compiles one step graph for every value).
    Under DDP the scaled loss's gradients are all-reduced as the loss's would be."""
    def forward(*args):
        return net(*args) * scale
    return forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--spike", action="append", default=[], help="STEP:LOSS_SCALE (1-based step), repeatable")
    ap.add_argument("--spike-rank", type=int, default=0)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    spikes = {int(s.split(":")[0]): float(s.split(":")[1]) for s in a.spike}
    cfg = config.load(TrainConfig, "configs/pretrain_smoke.yaml", a.overrides)
    rt = runtime.setup(cfg.device, cfg.precision)
    tr = pretrain.Trainer(cfg, rt)
    scale = torch.ones((), device=rt.device)
    rt.replicate([scale])
    net = spiked(rt.wrap(tr.model), scale)
    _, dl = tr.train_loader(0, a.steps)
    it = iter(rt.loader(dl))
    states, skipped, compiles = [], [], []
    for step in range(1, a.steps + 1):
        set_scalar(scale, spikes.get(step, 1.0) if rt.rank == a.spike_rank else 1.0)
        tr.update([rt.to_device(next(it))], net)
        rt.sync()
        st = tr.state()
        states.append(copy.deepcopy({k: st[k] for k in ("model", "target", "optimizer")}))  # CPU tensors alias
        skipped.append(int(st["skipped_updates"]))
        if rt.kind == "xla":
            compiles.append(xla_compiles()["xla_compiles"])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    torch.save({"states": states, "skipped": skipped, "compiles": compiles}, Path(a.out) / f"rank{rt.rank}.pt")
    rt.shutdown()


if __name__ == "__main__":
    main()

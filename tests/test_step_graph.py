"""The training step as an accelerator runs it (issue 62): no read back to the host inside a
steady step, one graph for dynamo (encoder, predictor and loss, with the attention routed as
on CUDA), and a bf16 residual stream under autocast."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import tiny_train_args
from octfm import config
from train import attention, data, pretrain, runtime
from train.config import TrainConfig
from train.model import target_features

SMOKE = "configs/pretrain_smoke.yaml"
# the learning check's architecture in small: stem, peak pooling, max pooling, the local term
CHECK_LIKE = {"model.stem": "[4]", "model.stem_pool": "max", "model.pool": "max", "loss.local": 1.0}

# ops that read a tensor's value on the host: on CUDA each waits for the device
HOST_READ_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")
HOST_READ_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


def _trainer(cache, runs, precision="fp32", **extra) -> pretrain.Trainer:
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(cache, runs, **{**CHECK_LIKE, **extra}))
    return pretrain.Trainer(cfg, runtime.setup("cpu", precision))


def _batches(tr: pretrain.Trainer, n: int) -> list[dict]:
    _, dl = tr.loader(tr.rows, 0, augment=True, shuffle=True, seed=0)
    it = iter(dl)
    return [next(it) for _ in range(n)]


class HostReads(TorchFunctionMode):
    """Records Python-level reads of tensor values to the host (float(t), t.item(), t.cpu(), ...)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS:  # (a .to("cpu") cannot be told from .to(device) on a CPU run)
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _inside(event, name: str) -> bool:
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False


def host_reads_in_steps(tr: pretrain.Trainer, batches: list[dict]) -> tuple[list[str], list[str]]:
    """(profiled aten reads, Python-level reads) of steady steps: the schedules' advance and
    `update`, as the loop runs them. The CPU build of fused AdamW reads its scalars per tensor
    inside its kernel (the CUDA kernel does not): those are not counted."""
    from torch.profiler import ProfilerActivity, profile

    for b in batches:  # warm: AdamW's state exists, every lazy first-call path has run
        tr.advance_schedules()
        tr.update([b], tr.model)
    mode = HostReads()
    with profile(activities=[ProfilerActivity.CPU]) as prof, mode:
        for b in batches:
            tr.advance_schedules()
            tr.update([b], tr.model)
    reads = [e.name for e in prof.events() if e.name in HOST_READ_OPS and not _inside(e, "aten::_fused_adamw_")]
    return reads, mode.seen


def test_a_steady_step_reads_nothing_back_to_the_host(tiny_cache, tmp_path):
    """The EMA's foreach lerp with a 0-dim tensor weight bound to the Scalar overload and read the
    weight with aten::item, a device sync every step on CUDA; nothing else may either. A skipped
    update (a spiked loss) takes the same path, so it is stepped too."""
    tr = _trainer(tiny_cache, tmp_path)
    bs = _batches(tr, 2)
    reads, py_reads = host_reads_in_steps(tr, bs)
    assert reads == [] and py_reads == [], (reads, py_reads)
    pretrain.set_scalar(tr.loss_scale, 1e4)  # every update now refused by the guard
    reads, py_reads = host_reads_in_steps(tr, bs)
    assert int(tr.skipped) > 0
    assert reads == [] and py_reads == [], (reads, py_reads)


def test_the_probe_sees_a_host_read():
    """The detectors above are live: a float() of a tensor and a Scalar-bound foreach lerp are seen."""
    from torch.profiler import ProfilerActivity, profile

    t = [torch.zeros(3)]
    mode = HostReads()
    with profile(activities=[ProfilerActivity.CPU]) as prof, mode:
        float(t[0].sum())
        torch._foreach_lerp_(t, [torch.ones(3)], torch.tensor(0.5))
    assert "__float__" in mode.seen
    assert sum(e.name == "aten::item" for e in prof.events()) >= 2


def test_the_ema_update_is_exact_on_a_skip_and_a_lerp_otherwise():
    torch.manual_seed(0)
    from train.config import ModelConfig
    from train.model import Encoder

    cfg = ModelConfig(dim=16, depth=1, heads=2, pred_dim=8, pred_depth=1, pred_heads=2)
    online, target = Encoder(cfg, (8, 32, 32)), Encoder(cfg, (8, 32, 32))
    before = [p.clone() for p in target.parameters()]
    pretrain.ema_update(target, online, torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))
    pretrain.ema_update(target, online, torch.tensor(0.99))
    for b, o, t in zip(before, online.parameters(), target.parameters()):
        torch.testing.assert_close(t, torch.lerp(b, o, 0.01), rtol=1e-6, atol=1e-7)

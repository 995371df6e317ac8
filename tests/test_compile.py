"""`compile: true` (torch.compile of the student and the target): the compiled
training step computes what the eager one does, and compiles once."""
import pytest
import torch
from torch._dynamo.utils import counters

from conftest import tiny_train_args
from octfm import config
from train import data, pretrain, runtime
from train.config import TrainConfig
from train.model import target_features

SMOKE = "configs/pretrain_smoke.yaml"


def _trainer(cache, runs, compiled: bool) -> pretrain.Trainer:
    # the recipe in small (stem, peak pooling, the local term: the defaults), a stem of 4 channels
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(cache, runs, **{
        "compile": str(compiled).lower(), "model.stem": "[4]"}))
    tr = pretrain.Trainer(cfg, runtime.setup("cpu", "fp32"))
    tr.lr.fill_(1e-3)
    tr.momentum.fill_(0.99)
    return tr


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _grads(tr: pretrain.Trainer, b: dict) -> torch.Tensor:
    """Every gradient of one forward and backward (the loss the update would take), flat."""
    x = data.normalize(b["x"], b["aug"])
    loss = tr.model(x, data.mask_pairs(b), target_features(tr.target, x))
    loss.backward()
    g = torch.cat([p.grad.flatten() for p in tr.model.parameters()])
    tr.opt.zero_grad(set_to_none=True)
    return g


@pytest.mark.slow  # inductor compiles three graphs: about a minute on 2 cores
def test_compiled_step_agrees_with_eager_and_compiles_once(tiny_cache, tmp_path):
    torch._dynamo.reset()
    eager = _trainer(tiny_cache, tmp_path / "e", compiled=False)
    comp = _trainer(tiny_cache, tmp_path / "c", compiled=True)
    _, dl = eager.train_loader(0)
    it = iter(dl)
    batches = [next(it) for _ in range(3)]
    ge, gc = _grads(eager, batches[0]), _grads(comp, batches[0])  # the same weights (the same seed built both)
    assert _rel(gc, ge) <= 1e-5
    for b in batches:  # three updates: the losses stay together (AdamW's steps are sign-like, so
        le = eager.update([b], eager.model)[0]  # weights are compared through the loss they give)
        lc = comp.update([b], comp.model)[0]
        assert abs(float(lc) - float(le)) <= 1e-5 * abs(float(le)), (float(lc), float(le))

    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # it did compile
    for b in batches * 2:  # warmed up: new data, same shapes, no new graph
        comp.update([b], comp.model)
    assert counters["stats"]["unique_graphs"] == graphs

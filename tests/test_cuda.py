"""The CUDA path (marker `cuda`; skipped without a GPU; `make device-check` runs them on a lent
H100/H200): a bf16 step through the fused attention kernels, the fused-AdamW skip deciding as
the CPU does, the prefetcher's side-stream copies in order, compiled and eager steps agreeing,
one fine-tuning epoch, `make embed` in bf16, the learning check's supervised reference (make finetune
from random init) and its probe heads on the GPU."""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import run_cli, same_optimizer, same_weights, tiny_train_args
from guard_driver import spiked
from octfm import config
from train import attention, checkpoint, pretrain, runtime
from train.config import TrainConfig
from train.optim import guard_path
from train.schedule import set_scalar

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (make device-check runs these)")]

SMOKE = "configs/pretrain_smoke.yaml"


def trainer(cache, tmp_path, precision: str = "bf16", **kw) -> pretrain.Trainer:
    args = tiny_train_args(cache, tmp_path, device="cuda", precision=precision, **kw)
    cfg = config.load(TrainConfig, SMOKE, args)
    return pretrain.Trainer(cfg, runtime.setup("cuda", cfg.precision))


def batches(tr: pretrain.Trainer, n: int) -> list[dict]:
    _, dl = tr.train_loader(0, n)
    return [tr.rt.to_device(b) for b in dl]


def test_a_bf16_step_runs_the_fused_attention_and_learns(tiny_cache, tmp_path):
    tr = trainer(tiny_cache, tmp_path, max_steps=20)
    assert tr.rt.bf16 and attention.kernel_for("cuda") == attention.SDPA_FUSED
    bs = batches(tr, 4)
    first = None
    for i in range(20):
        tr.advance_schedules()
        loss, gnorm, _ = tr.update([bs[i % 4]], tr.model)
        first = float(loss) if first is None else first
        assert torch.isfinite(loss) and torch.isfinite(gnorm)
    assert float(loss) < first and int(tr.guard.skipped) == 0
    # steady steps read nothing back to the host: any synchronising call raises in this mode
    # (tests/test_step_graph.py holds the same on the CPU with the profiler)
    scale = torch.ones((), device="cuda")
    net = spiked(tr.model, scale)
    for value, steps in ((1.0, 3), (1e4, 1)):  # then a skipped update, which takes the same path
        set_scalar(scale, value)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(steps):
                tr.advance_schedules()
                tr.update([bs[i % 4]], net)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert int(tr.guard.skipped) == 1
    # the fused kernels alone: a math fallback would have raised inside sdpa_kernel
    q = torch.randn(2, 4, 3000, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()  # the trainer, its batches and q stay allocated
    attention.attend(q, q, q)
    assert torch.cuda.max_memory_allocated() - held < 2 * 4 * 3000 * 3000  # no [B, H, N, N] bf16 scores


def test_the_residual_stream_and_the_norms_stay_bf16_under_cuda_autocast(tiny_cache, tmp_path):
    """CUDA's autocast runs nn.LayerNorm in float32 and returns float32; the model's norms read and
    write bf16, and every block's input and output is bf16 (tests/test_step_graph.py on the CPU)."""
    tr = trainer(tiny_cache, tmp_path)
    b = batches(tr, 1)[0]
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.append((type(mod).__name__, i[0].dtype, o.dtype)))
             for m in tr.model.modules() if type(m).__name__ in ("Block", "LayerNorm")]
    try:
        tr.update([b], tr.model)
    finally:
        for h in hooks:
            h.remove()
    assert seen and all(i == o == torch.bfloat16 for _, i, o in seen), set(seen)


def test_the_fused_adamw_skip_decides_as_the_cpu(tiny_cache, tmp_path):
    """A spiked and a NaN loss on CUDA leave weights, EMA target and AdamW state bit-identical
    (fused AdamW's found_inf), as the CPU run of the same code does."""
    out = {}
    for dev in ("cpu", "cuda"):
        args = tiny_train_args(tiny_cache, tmp_path / dev, device=dev, precision="fp32")
        cfg = config.load(TrainConfig, SMOKE, args)
        tr = pretrain.Trainer(cfg, runtime.setup(dev, cfg.precision))
        assert guard_path(tr.opt, torch.zeros((), dtype=torch.bool, device=dev)) == "found_inf"
        bs = batches(tr, 3)
        states, skipped = [], []
        scale = torch.ones((), device=dev)
        net = spiked(tr.model, scale)
        for i, value in enumerate([1.0, 1e4, float("nan"), 1.0]):
            set_scalar(scale, value)
            tr.advance_schedules()
            tr.update([bs[i % 3]], net)
            st = tr.state()
            states.append(copy.deepcopy({k: st[k] for k in ("model", "target", "optimizer")}))
            skipped.append(int(st["skipped_updates"]))
        out[dev] = skipped
        assert same_weights(states[0], states[1]) and same_optimizer(states[0], states[1])
        assert same_weights(states[1], states[2]) and same_optimizer(states[1], states[2])
        assert not same_weights(states[2], states[3])
    assert out["cpu"] == out["cuda"] == [0, 1, 2, 2]


def test_the_prefetcher_hands_out_side_stream_copies_in_order():
    def loader():
        for i in range(6):
            yield {"x": torch.full((64, 1024), float(i)).pin_memory(), "aug": torch.tensor([i]).pin_memory()}

    seen = []
    for b in runtime.Prefetcher(loader(), "cuda"):
        assert b["x"].is_cuda
        seen.append(int(b["aug"][0]))
        assert torch.all(b["x"] == seen[-1])  # the compute stream sees the finished copy
        torch.cuda._sleep(1_000_000)           # a slow step: the next copy runs meanwhile
    assert seen == list(range(6))


def test_compiled_and_eager_steps_agree(tiny_cache, tmp_path):
    losses = {}
    for compile_ in (False, True):
        torch.manual_seed(0)
        tr = trainer(tiny_cache, tmp_path / str(compile_), compile=str(compile_).lower(), precision="fp32")
        net = tr.network()
        bs = batches(tr, 3)
        out = []
        for i in range(3):
            tr.advance_schedules()
            out.append(float(tr.update([bs[i]], net)[0]))
        losses[compile_] = out
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-3)


def test_one_finetuning_epoch_on_cuda(signal_cache, tmp_path):
    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", "device=cuda",
                *tiny_train_args(signal_cache, tmp_path / "runs", name="p", max_steps=2, ckpt_every=2))
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = tmp_path / "runs" / "p" / "checkpoints" / "step_0000002.pt"
    r = run_cli("evals.finetune", "--no-progress", "--ckpt", str(ckpt), f"out={tmp_path / 'ft'}", "epochs=1",
                "device=cuda", "precision=bf16", "workers=0", "global_batch=4", "bootstrap=20", "patience=0",
                "frozen_epochs=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on cuda" in r.stdout and "diabetic (test, best val epoch" in r.stdout


def test_make_embed_in_bf16_on_cuda(tiny_run, tmp_path):
    ckpt = str(tiny_run / "checkpoints" / "latest.pt")
    outs = {}
    for prec in ("fp32", "bf16"):
        out = tmp_path / f"{prec}.parquet"
        r = run_cli("evals.embed", "--ckpt", ckpt, "--out", str(out), "--precision", prec, "--device", "cuda",
                    "--no-progress")
        assert r.returncode == 0, r.stderr[-3000:]
        outs[prec] = np.stack(pd.read_parquet(out).sort_values("relpath").embedding.to_numpy())
    rel = np.linalg.norm(outs["bf16"] - outs["fp32"], axis=1) / np.linalg.norm(outs["fp32"], axis=1)
    assert rel.max() < 0.05, rel.max()


def test_the_reference_trains_on_the_gpu_in_bf16(tiny_cache, tmp_path, monkeypatch):
    """The check's supervised reference is `make finetune` from random init; on device=cuda it trains
    there under bf16 autocast, scored on val by steps as the GPU size asks (val_every), and its best
    state is saved as CPU tensors."""
    from evals import finetune
    from evals.config import FinetuneConfig

    seen = []
    real = torch.nn.Linear.forward

    def spy(self, x):
        out = real(self, x)
        seen.append((out.device.type, out.dtype))  # under autocast a linear layer's output is bf16
        return out

    args = tiny_train_args(tiny_cache, tmp_path / "runs", name="p", max_steps=2, ckpt_every=2)
    pretrain.main(["--config", SMOKE, "--no-progress", *args])
    cfg = config.load(FinetuneConfig, "configs/finetune.yaml", [
        f"ckpt={tmp_path / 'runs' / 'p' / 'checkpoints' / 'latest.pt'}", f"out={tmp_path / 'ref'}", "init=random",
        "device=cuda", "precision=bf16", "workers=null", "epochs=100000", "max_steps=2", "val_every=1", "patience=1",
        "frozen_epochs=0", "bootstrap=20"])
    monkeypatch.setattr(torch.nn.Linear, "forward", spy)
    ft = finetune.Finetuner(cfg, runtime.setup("cuda", "bf16"))
    res = ft.run(progress=False)
    assert seen and all(d == "cuda" for d, _ in seen) and ("cuda", torch.bfloat16) in seen
    st = checkpoint.load(res["best_checkpoint"])
    assert all(v.device.type == "cpu" for v in st["target"].values())
    assert [h["step"] for h in ft.history][:2] == [1, 2]  # scored on the GPU at each step


@pytest.mark.parametrize("kind", ["linear", "attentive"])
def test_the_probe_heads_train_on_the_gpu_as_on_the_cpu(kind):
    """The check's probe heads on its device (the GPU size's 589 s of host CPU, docs/accelerators.md):
    the same initial weights and batch order as on the CPU, so the predictions agree to float32
    rounding (TF32 off here), and every head of the grid trains."""
    from evals import probe_heads

    rng = np.random.default_rng(0)
    n, tokens, dim = 240, 24, 16
    y = rng.integers(0, 3, n)
    t = (rng.normal(size=(n, tokens, dim)) + y[:, None, None] * 0.3).astype(np.float32)
    pooled, grid = t.mean(1), [(1e-2, 0.0), (1e-3, 0.1)]
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        probs = {dev: probe_heads.train_heads(kind, grid, pooled[:160], t[:160], y[:160], 3, 4, 32, 0, standardize=True,
                                              device=dev)(pooled[160:], t[160:]) for dev in ("cpu", "cuda")}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert probs["cuda"].shape == probs["cpu"].shape == (2, 80, 3)
    np.testing.assert_allclose(probs["cuda"], probs["cpu"], atol=2e-3)
    assert not np.allclose(probs["cpu"][0], probs["cpu"][1], atol=1e-3)  # the grid's two heads differ

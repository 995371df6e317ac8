"""The training step as an accelerator runs it: no read back to the host inside a
steady step, one graph for dynamo (encoder, predictor and loss, with the attention routed as
on CUDA), and a bf16 residual stream under autocast."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import tiny_train_args
from guard_driver import spiked
from octfm import config
from train import attention, data, pretrain, runtime
from train.config import TrainConfig
from train.model import target_features
from train.ema import ema_update
from train.schedule import set_scalar

SMOKE = "configs/pretrain_smoke.yaml"

# ops that read a tensor's value on the host: on CUDA each waits for the device
HOST_READ_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")
HOST_READ_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


def _trainer(cache, runs, precision="fp32", **extra) -> pretrain.Trainer:
    # the recipe in small (stem, peak pooling, max pooling, the local term: the defaults), a stem of 4 channels
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(cache, runs, **{"model.stem": "[4]", **extra}))
    return pretrain.Trainer(cfg, runtime.setup("cpu", precision))


def _batches(tr: pretrain.Trainer, n: int) -> list[dict]:
    _, dl = tr.train_loader(0)
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


def host_reads_in_steps(tr: pretrain.Trainer, batches: list[dict], net) -> tuple[list[str], list[str]]:
    """(profiled aten reads, Python-level reads) of steady steps: the schedules' advance and
    `update`, as the loop runs them. The CPU build of fused AdamW reads its scalars per tensor
    inside its kernel (the CUDA kernel does not): those are not counted."""
    from torch.profiler import ProfilerActivity, profile

    for b in batches:  # warm: AdamW's state exists, every lazy first-call path has run
        tr.advance_schedules()
        tr.update([b], net)
    mode = HostReads()
    with profile(activities=[ProfilerActivity.CPU]) as prof, mode:
        for b in batches:
            tr.advance_schedules()
            tr.update([b], net)
    reads = [e.name for e in prof.events() if e.name in HOST_READ_OPS and not _inside(e, "aten::_fused_adamw_")]
    return reads, mode.seen


def test_a_steady_step_reads_nothing_back_to_the_host(tiny_cache, tmp_path):
    """The EMA's foreach lerp with a 0-dim tensor weight bound to the Scalar overload and read the
    weight with aten::item, a device sync every step on CUDA; nothing else may either. A skipped
    update (a spiked loss) takes the same path, so it is stepped too."""
    tr = _trainer(tiny_cache, tmp_path)
    bs = _batches(tr, 2)
    scale = torch.ones(())
    net = spiked(tr.model, scale)
    reads, py_reads = host_reads_in_steps(tr, bs, net)
    assert reads == [] and py_reads == [] and int(tr.guard.skipped) == 0, (reads, py_reads)
    set_scalar(scale, 1e4)  # every update now refused by the guard
    reads, py_reads = host_reads_in_steps(tr, bs, net)
    assert int(tr.guard.skipped) > 0
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
    ema_update(target, online, torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))
    ema_update(target, online, torch.tensor(0.99))
    for b, o, t in zip(before, online.parameters(), target.parameters()):
        torch.testing.assert_close(t, torch.lerp(b, o, 0.01), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- one graph
class Captured(Exception):
    """Raised by the recording backend: dynamo traced the whole function as one graph."""


def capture_backend(gm, example_inputs):
    raise Captured(len(list(gm.graph.nodes)))


def one_graph_nodes(fn, *args) -> int:
    """Trace `fn(*args)` with dynamo as one graph (fullgraph: any break raises) and stop there: the
    backend records the graph and raises, so nothing is compiled or run (ViT-B at the production
    crop traces on fake tensors in seconds). Returns the graph's node count."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=capture_backend, fullgraph=True)(*args)
    except Exception as exc:  # the backend's Captured arrives wrapped by dynamo
        cause = exc
        while cause is not None and not isinstance(cause, Captured):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return cause.args[0]
    finally:
        torch._dynamo.reset()
    raise AssertionError("the backend was never called")


# the same blocks at the config's widths and shapes, fewer of them: a block traces (and runs) alike at any depth
SHALLOW = ("model.depth=2", "model.pred_depth=1")
TINY = (*SHALLOW, "model.dim=32", "model.heads=2", "model.pred_dim=16", "model.pred_heads=2")


def model_step(config_path: str, batch: int = 1, overrides=()):
    """(step function, its arguments) for a config's student and target at its crop: normalise
    the uint8 batch, the EMA encoder's targets and the student's loss over every mask set, under
    bf16 autocast (as on CUDA), on random mask ids of the calibrated fixed sizes."""
    from train import masks
    from train.model import JEPA, Encoder

    cfg = config.load(TrainConfig, config_path, list(overrides))
    torch.manual_seed(0)
    grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
    student = JEPA(cfg.model, cfg.data.input_shape, cfg.loss)
    target = Encoder(cfg.model, cfg.data.input_shape).requires_grad_(False)
    pairs = [(torch.randint(0, grid.tokens, (batch, s.context_cells * grid.depth), dtype=torch.int32),
              torch.randint(0, grid.tokens, (batch, s.target_cells * grid.depth), dtype=torch.int32))
             for s in masks.calibrate(grid, cfg.mask, seed=0)]
    x = torch.randint(0, 256, (batch, 1, *cfg.data.input_shape), dtype=torch.uint8)
    aug = torch.tensor([[1.0, 0.0]] * batch)

    def step(x_u8, aug, pairs):
        x = data.normalize(x_u8, aug)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return student(x, pairs, target_features(target, x))

    return step, (x, aug, pairs)


@pytest.fixture
def routed_as_cuda(monkeypatch):
    """`attend` takes the CUDA route (SDPA limited to the fused kernels, set once per process);
    the process's SDPA flags are put back after."""
    from torch.nn.attention import _cur_sdpa_kernel_backends, _sdpa_kernel

    saved, order = _cur_sdpa_kernel_backends(), torch._C._get_sdp_priority_order()
    monkeypatch.setattr(attention, "kernel_for", lambda *a: attention.SDPA_FUSED)
    attention.use_fused_kernels()
    yield
    _sdpa_kernel(saved)
    torch._C._set_sdp_priority_order(order)
    attention._FUSED_ONLY = False


@pytest.mark.parametrize("config_path, depth", [
    pytest.param("configs/pretrain_check_gpu.yaml", SHALLOW, id="check_gpu"),
    pytest.param("configs/pretrain_multi_domain.yaml", SHALLOW, id="production"),
    pytest.param("configs/pretrain_multi_domain.yaml", (), marks=pytest.mark.slow, id="production_full_depth")])
def test_the_step_traces_as_one_graph(config_path, depth, routed_as_cuda):
    """Encoder, predictor, targets and loss in one dynamo graph, no break, at the GPU-size check's
    and the production config's widths and shapes: what `compile: true` compiles. The light lane traces
    two encoder blocks and one predictor block (the blocks repeat); the heavy lane the whole depth."""
    step, args = model_step(config_path, overrides=depth)
    assert one_graph_nodes(step, *args) > 100


def test_a_graph_break_is_caught(routed_as_cuda):
    """The tracer above fails on a break (a host read inside the step), so it can fail."""
    step, args = model_step("configs/pretrain_check_gpu.yaml", overrides=TINY)

    def broken(*a):
        loss = step(*a)
        if float(loss) > 0:  # reads the loss on the host: dynamo must break the graph here
            loss = loss * 1.0
        return loss

    with pytest.raises(Exception, match="(?i)graph break|unsupported|data-dependent|item"):
        one_graph_nodes(broken, *args)


# ----------------------------------------------------------------------------- bf16
def test_the_residual_stream_and_the_norms_stay_bf16_under_autocast():
    """Under bf16 autocast every block reads and writes bf16 and every LayerNorm returns bf16: a
    float32 position table added to the tokens made the whole stream float32 (each norm then ran
    in float32 and each Linear first cast its input). CPU autocast leaves a bf16 norm in bf16
    anyway; CUDA's runs norms in float32, which tests/test_cuda.py checks the model avoids there."""
    from train.model import LayerNorm

    step, (x, aug, pairs) = model_step("configs/pretrain_check_gpu.yaml", batch=2, overrides=TINY)
    student = step.__closure__[[c.cell_contents.__class__.__name__ for c in step.__closure__].index("JEPA")].cell_contents
    seen = []

    def record(mod, inputs, out):
        seen.append((type(mod).__name__, inputs[0].dtype, out.dtype))

    hooks = [m.register_forward_hook(record) for m in student.modules() if type(m).__name__ in ("Block", "LayerNorm")]
    assert any(isinstance(m, LayerNorm) for m in student.modules())
    try:
        loss = step(x, aug, pairs)
    finally:
        for h in hooks:
            h.remove()
    assert seen and all(i == o == torch.bfloat16 for _, i, o in seen), set(seen)
    assert loss.dtype == torch.float32  # the loss itself is reduced in float32


def test_the_bf16_step_stays_close_to_float32(tiny_cache, tmp_path):
    """The same weights and batch: the bf16 loss and gradients agree with float32's within bf16's
    precision (a residual stream or norm in the wrong dtype would not break this; an arithmetic
    error would)."""
    eager = {}
    for precision in ("fp32", "bf16"):
        tr = _trainer(tiny_cache, tmp_path / precision, precision=precision)
        b = _batches(tr, 1)[0]
        x = data.normalize(b["x"], b["aug"])
        with tr.rt.autocast():
            loss = tr.model(x, data.mask_pairs(b), target_features(tr.target, x))
        loss.backward()
        eager[precision] = (float(loss.detach()), torch.cat([p.grad.flatten() for p in tr.model.parameters()]))
    (l32, g32), (l16, g16) = eager["fp32"], eager["bf16"]
    assert abs(l16 - l32) <= 0.02 * abs(l32)
    assert float((g16 - g32).norm() / g32.norm()) <= 0.05

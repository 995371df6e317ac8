"""`make plan CONFIG=... ACCEL=<tpu-v4|tpu-v5e|tpu-v5p|h100|h200> [CHIPS=N]`: will it fit, how long?

An analytic per-chip memory plan of a pretraining config at its real shapes (token counts from
the same mask calibration the trainer runs), with the attention kernel `train.attention` routes
to on that accelerator: parameters, the EMA target, gradients, AdamW state, the update guard's
copies (XLA), and per sample the activations kept for the backward, block by block. It lays the
config's global batch over the chips as the trainer will (train/batching.py), says whether a
chip's batch fits, with what margin, and the largest batch per chip that does; then an estimate
of the step time, the days for max_steps and the chip-hours, from the step's FLOPs (counted on
fake tensors: step_flops) and a stated utilisation per accelerator kind (ASSUMED_UTILISATION),
labelled an estimate until a measured step replaces it (docs/accelerators.md).

Activation bytes follow what autograd saves (tests/test_plan.py counts the storages it keeps
on a CPU: equal for a block, within 3% for the whole student): under bf16 autocast the residual
stream and layer-norm inputs are float32, matmul inputs and outputs bfloat16. It is an estimate:
XLA and the CUDA caching allocator add fragmentation and workspace, which the usable share of
each chip's memory leaves room for (docs/accelerators.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Sequence

import torch

from octfm import cli, config
from train import attention, batching, masks
from train.config import TrainConfig

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Accelerator:
    device: str               # the runtime's kind: xla or cuda
    platform: str | None      # PJRT device type for xla
    memory_gib: float         # per chip
    chips_per_host: int       # chips of one machine (a TPU VM host; a GPU node)
    chips_per_process: int    # chips one process feeds (XLA SPMD: the host's; CUDA: one process per GPU)
    bf16_tflops: float        # dense peak per chip, for MFU
    usable: float             # the share of memory a plan may fill (runtime, compiler and allocator keep the rest)

    @property
    def utilisation(self) -> float:
        """The share of bf16_tflops a step is assumed to reach (ASSUMED_UTILISATION, per kind)."""
        return ASSUMED_UTILISATION[self.device]


# The step time estimate's one assumption per kind: the share of the bf16 peak the ViT-B step reaches.
# Nothing here measured it: on CUDA, 25% of the H200's measured bf16 matmul rate (763 of a 989 TFLOP/s
# datasheet peak), the rate `make device-check` predicts with (bench/device_budget.py GPU_ASSUMED); on TPU the
# same 19% of the peak, for want of any TPU reading. A measured step replaces it (docs/accelerators.md).
ASSUMED_UTILISATION = {"cuda": 0.19, "xla": 0.19}

# Per chip. TPU: HBM per chip and chips per host of the Cloud TPU VM types; CUDA: one process per
# GPU on a node of 8, the memory torch reports on the lent cards (docs/accelerators.md).
ACCELERATORS = {
    "tpu-v4": Accelerator("xla", "TPU", 32.0, 4, 4, 275.0, 0.90),
    "tpu-v5e": Accelerator("xla", "TPU", 16.0, 4, 4, 197.0, 0.90),
    "tpu-v5p": Accelerator("xla", "TPU", 95.0, 4, 4, 459.0, 0.90),
    "h100": Accelerator("cuda", None, 79.2, 8, 1, 989.0, 0.90),
    "h200": Accelerator("cuda", None, 139.8, 8, 1, 989.0, 0.90),
}
LOADER_CORE_S = 0.085  # one core's seconds per production sample's random-resized crop (docs/training.md, Data)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The token counts and widths a step runs at."""
    voxels: int                      # D x H x W of one crop
    tokens: int                      # the full grid (the target encoder's sequence)
    context: tuple[int, ...]         # context tokens per mask set (the encoder's sequences)
    targets: tuple[int, ...]         # target tokens per mask set
    stem: tuple[int, ...]
    local_cells: int                 # the local head's outputs per token (0: no local term)
    dim: int
    depth: int
    heads: int
    mlp_ratio: float
    pred_dim: int
    pred_depth: int
    pred_heads: int


def shapes(cfg: TrainConfig) -> Shapes:
    from train.model import local_outputs

    m = cfg.model
    grid = masks.grid_for(cfg.data.input_shape, m.tubelet)
    sizes = masks.calibrate(grid, cfg.mask, seed=cfg.seed)
    local = local_outputs(cfg.loss, m.tubelet) if cfg.loss.local > 0 else 0
    return Shapes(math.prod(cfg.data.input_shape), grid.tokens, tuple(s.context_cells * grid.depth for s in sizes),
                  tuple(s.target_cells * grid.depth for s in sizes), tuple(m.stem), local, m.dim, m.depth, m.heads,
                  m.mlp_ratio, m.pred_dim, m.pred_depth, m.pred_heads)


def parameter_counts(cfg: TrainConfig) -> dict[str, int]:
    """Parameters of the student (encoder, predictor, local head), of the encoder alone (the EMA
    copy) and in the student's weight matrices (autocast's copies), counted on the meta device."""
    from train.model import JEPA

    with torch.device("meta"):
        model = JEPA(cfg.model, cfg.data.input_shape, cfg.loss)
    return {"student": sum(p.numel() for p in model.parameters()),
            "encoder": sum(p.numel() for p in model.encoder.parameters()),
            "matrices": sum(p.numel() for p in model.parameters() if p.ndim > 1)}


def attention_saved(length: int, heads: int, dim: int, act: int, kernel: str) -> int:
    """Bytes an attention call keeps for its backward beyond q, k, v (views of the qkv output):
    its output and row statistics (log-sum-exp) on a fused kernel; on the math path the
    probabilities [H, N, N] and q, k, v upcast, all in float32 (PyTorch upcasts bf16 there):
    quadratic in the length."""
    if attention.MEMORY[kernel] == "linear":
        return length * (act * dim + 4 * heads)
    return 4 * heads * length * length + length * (3 * 4 * dim + act * dim)


def block_saved(length: int, dim: int, heads: int, mlp_ratio: float, act: int, kernel: str) -> int:
    """One pre-norm transformer block over `length` tokens: the float32 residual into both norms
    and their statistics, the norms' outputs as the linears' inputs (cast to `act` bytes), the
    qkv output (q, k and v are views of it), fc1's output and the GELU's, and attention's own."""
    hidden = int(dim * mlp_ratio)
    per_token = 2 * (4 * dim + 8) + 2 * dim * act + 3 * dim * act + 2 * hidden * act
    return length * per_token + attention_saved(length, heads, dim, act, kernel)


def weight_casts(params: dict, act: int) -> int:
    """Copies of every weight matrix in `act` bytes (bf16 autocast makes one per step and keeps
    it for the backward); none in float32."""
    return 0 if act == 4 else act * params["matrices"]


def stem_saved(shp: Shapes, act: int) -> int:
    """The stem and the patchify: the input cast for the first convolution's weight gradient,
    each convolution's output (GELU input) and GELU output (the next input, the peak pool's
    input, and a permuted copy the patchify's matmul keeps)."""
    v = shp.voxels * act  # the normalised volume, cast
    c_in = 1
    total = v
    area = shp.voxels
    for c in shp.stem:
        area //= 4  # each stem convolution halves rows and columns
        total += 2 * c * area * act  # conv out (GELU's input) and GELU out
        c_in = c
    if shp.stem:
        total += c_in * area * act  # the patchify's permuted copy of the last GELU output
        total += c_in * shp.tokens * 8  # the peak pool's int64 indices
    return total


def sequence_saved(shp: Shapes, act: int, kernel: str) -> dict[str, int]:
    """Activation bytes per sample kept for the backward, by part."""
    enc = sum(shp.depth * block_saved(n, shp.dim, shp.heads, shp.mlp_ratio, act, kernel) for n in shp.context)
    enc += sum(n * (4 * shp.dim + 8) for n in shp.context)  # the final norm's input
    pred = 0
    for c, t in zip(shp.context, shp.targets):
        pred += shp.pred_depth * block_saved(c + t, shp.pred_dim, shp.pred_heads, shp.mlp_ratio, act, kernel)
        pred += c * shp.dim * act                            # the embedding's input
        # the final norm's input: the target rows are a view of the whole sequence, so autograd keeps its
        # storage, context rows included; then the target rows' statistics and the output linear's input
        pred += (c + t) * 4 * shp.pred_dim + t * (8 + shp.pred_dim * act)
        pred += t * shp.dim * 4                              # the L1's difference (float32)
    local = sum(n * (shp.dim * act + shp.local_cells * 4) for n in shp.context) if shp.local_cells else 0
    return {"stem": stem_saved(shp, act), "encoder": enc, "predictor": pred, "local_head": local}


def target_pass(shp: Shapes, act: int, kernel: str) -> tuple[int, int]:
    """(kept, transient) bytes per sample of the EMA target's pass over all tokens (no grad):
    the float32 targets kept for the loss, and the largest block's working set while it runs."""
    n, d = shp.tokens, shp.dim
    hidden = int(d * shp.mlp_ratio)
    work = n * (2 * 4 * d + d * act + 3 * d * act + 2 * hidden * act)
    if attention.MEMORY[kernel] == "quadratic":
        work += 2 * 4 * shp.heads * n * n
    stem = shp.voxels * (4 + act) + sum(2 * c * shp.voxels // 4 ** (i + 1) * act for i, c in enumerate(shp.stem))
    return n * d * 4, max(work, stem)


def step_flops(cfg: TrainConfig) -> float:
    """FLOPs of one volume's update: the target's pass and the student's forward and backward, as
    torch's FlopCounterMode counts them on fake tensors (no arithmetic runs; seconds at ViT-B), with
    the CPU's fused attention counted as the flash kernels are (the counter knows the GPU's only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils import flop_counter

    from train import data
    from train.model import JEPA, Encoder, target_features

    grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
    sizes = masks.calibrate(grid, cfg.mask, seed=cfg.seed)
    with torch.device("meta"):
        student = JEPA(cfg.model, cfg.data.input_shape, cfg.loss)
        target = Encoder(cfg.model, cfg.data.input_shape).requires_grad_(False)
    aten = torch.ops.aten
    mapping = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = \
            lambda q, k, v, *a, **kw: flop_counter.sdpa_flop_count(q, k, v)
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
            lambda grad, q, k, v, *a, **kw: flop_counter.sdpa_backward_flop_count(grad, q, k, v)
    with FakeTensorMode(allow_non_fake_inputs=True):
        student.to_empty(device="cpu")
        target.to_empty(device="cpu")
        x = torch.zeros((1, 1, *cfg.data.input_shape), dtype=torch.uint8)
        pairs = [(torch.zeros((1, s.context_cells * grid.depth), dtype=torch.int32),
                  torch.zeros((1, s.target_cells * grid.depth), dtype=torch.int32)) for s in sizes]
        with flop_counter.FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            xn = data.normalize(x, torch.tensor([[1.0, 0.0]]))
            student(xn, pairs, target_features(target, xn)).backward()
    return float(counter.get_total_flops())


@dataclasses.dataclass
class Plan:
    config: str
    accel: str
    kernel: str
    shapes: Shapes
    split: batching.Split
    params_m: float
    static_gib: dict
    per_sample_gib: dict
    step_extra_gib: float     # the update guard's copies at the optimizer step (XLA), activations freed
    peak_gib: float
    capacity_gib: float
    fits: bool
    margin_gib: float
    largest_batch: int
    suggestion: str | None    # the chip_batch that makes a global batch fit, when it does not
    max_steps: int
    flops: float | None       # one volume's update (step_flops); None: not counted

    @property
    def chips(self) -> int:
        return self.split.chips

    @property
    def batch_per_chip(self) -> int:
        return self.split.per_chip

    @property
    def global_batch(self) -> int:
        return self.split.global_batch

    def estimate(self) -> dict | None:
        """Step seconds, days for max_steps and chip-hours at the assumed utilisation (an estimate)."""
        if not self.flops:
            return None
        acc = ACCELERATORS[self.accel]
        step_s = self.flops * self.global_batch / (self.chips * acc.bf16_tflops * 1e12 * acc.utilisation)
        total_s = step_s * self.max_steps
        return {"step_s": step_s, "days": total_s / 86400, "chip_hours": total_s * self.chips / 3600,
                "utilisation": acc.utilisation,
                "loader_cores": LOADER_CORE_S * self.split.per_host / step_s}

    def lines(self) -> list[str]:
        shp, b = self.shapes, self.batch_per_chip
        acc = ACCELERATORS[self.accel]
        verdict = "fits" if self.fits else "does NOT fit"
        seqs = ", ".join(f"{c} + {t}" for c, t in zip(shp.context, shp.targets))
        rows = list(self.static_gib.items())
        rows += [(f"{k} x {b:g}", v * b) for k, v in self.per_sample_gib.items()]
        width = max(len(k) for k, _ in rows) + 2
        hosts = self.split.hosts
        out = [
            f"plan: {self.config} on {self.chips} x {self.accel} ({hosts} host(s) of {acc.chips_per_host}; CHIPS=N for "
            f"another count): attention {self.kernel} ({attention.MEMORY[self.kernel]} in the sequence)",
            f"  {self.params_m:.1f} M student parameters; {shp.tokens} tokens per sample, per mask set context + "
            f"targets {seqs} (the predictor's sequence)",
            f"  {self.split.describe(shp.tokens)}",
            "  GiB per chip:",
            *(f"    {k:<{width}}{v:8.2f}" for k, v in rows),
            f"    {'peak (forward and backward)':<{width}}{self.peak_gib:8.2f}   of {self.capacity_gib:.1f} usable"
            + (f" (the step adds {self.step_extra_gib:.2f} for the update guard's copies, activations freed)"
               if self.step_extra_gib else ""),
            f"plan: the config {verdict} on {self.accel} at batch {b:g} per chip: margin {self.margin_gib:+.2f} GiB; "
            f"the largest batch that fits is {self.largest_batch} per chip",
        ]
        if self.suggestion:
            out.append(f"plan: {self.suggestion}")
        est = self.estimate()
        if est:
            out += [
                f"  FLOPs: {self.flops / 1e12:.2f} TFLOP a volume (target pass, student forward and backward), "
                f"{self.flops * self.global_batch / 1e15:.2f} PFLOP a step",
                f"plan: ESTIMATE (assumed {est['utilisation']:.0%} of the {acc.bf16_tflops:g} TFLOP/s bf16 peak per "
                f"chip, not measured): {est['step_s']:.2f} s a step; {self.max_steps:,} steps in {est['days']:.1f} days, "
                f"{est['chip_hours']:,.0f} chip-hours on {self.chips} chips",
                f"  the loader at that pace: {self.split.per_host} volumes a host a step at {LOADER_CORE_S * 1000:.0f} ms "
                f"of a core each need {est['loader_cores']:.1f} cores a host (data.workers)",
            ]
        return out


def memory(shp: Shapes, params: dict, acc: Accelerator, act: int, kernel: str) -> tuple[dict, dict, int]:
    """(static parts, per-sample parts, extra at the optimizer step) in bytes."""
    ps, pe = params["student"], params["encoder"]
    static = {"weights (student, fp32)": 4 * ps, "EMA target encoder": 4 * pe, "gradients": 4 * ps,
              "AdamW moments": 8 * ps, "bf16 weight copies": weight_casts(params, act)}
    if acc.device == "cuda":
        static["DDP gradient buckets"] = 4 * ps
    per_sample = sequence_saved(shp, act, kernel)
    kept, transient = target_pass(shp, act, kernel)
    per_sample["targets (fp32)"] = kept
    biggest_block = max(block_saved(c + t, shp.pred_dim, shp.pred_heads, shp.mlp_ratio, act, kernel)
                        for c, t in zip(shp.context, shp.targets))
    biggest_block = max(biggest_block, *(block_saved(n, shp.dim, shp.heads, shp.mlp_ratio, act, kernel)
                                         for n in shp.context))
    per_sample["working set (target pass or a block's backward)"] = max(transient, 2 * biggest_block)
    # XLA's update guard copies the weights and AdamW state before the step (copy-and-select)
    step_extra = 12 * ps if acc.device == "xla" else 0
    return static, per_sample, step_extra


def peak(static: dict, per_sample: dict, step_extra: int, batch: float) -> float:
    base = sum(static.values())
    return max(base + batch * sum(per_sample.values()), base + step_extra)


def machine(accel: Accelerator, chips: int) -> tuple[int, int]:
    """(processes, hosts) that feed `chips` chips of an accelerator kind."""
    if chips % accel.chips_per_process or (chips > accel.chips_per_host and chips % accel.chips_per_host):
        raise cli.UsageError(f"CHIPS={chips}: a host holds {accel.chips_per_host} chips and a process feeds "
                             f"{accel.chips_per_process}: use a multiple of {accel.chips_per_host} (or fewer on one host)")
    return chips // accel.chips_per_process, max(1, chips // accel.chips_per_host)


def make_plan(cfg: TrainConfig, accel: str, chips: int | None = None, name: str = "config",
              kernel: str | None = None, flops: bool = False) -> Plan:
    """The plan on `chips` chips of `accel` (default one host's), with the attention kernel the
    model routes to there (or `kernel`, to show what another would need); `flops`: count the
    step's FLOPs for the time estimate (seconds at ViT-B)."""
    if accel not in ACCELERATORS:
        raise cli.UsageError(f"ACCEL={accel!r}: one of {', '.join(ACCELERATORS)}")
    acc = ACCELERATORS[accel]
    chips = chips or acc.chips_per_host
    processes, hosts = machine(acc, chips)
    lay = batching.split(cfg.global_batch, cfg.chip_batch, chips, processes, hosts)
    kernel = kernel or attention.kernel_for(acc.device, acc.platform)
    act = 2 if cfg.precision == "bf16" else 4
    shp = shapes(cfg)
    params = parameter_counts(cfg)
    static, per_sample, step_extra = memory(shp, params, acc, act, kernel)
    capacity = acc.memory_gib * acc.usable * GIB
    need = peak(static, per_sample, step_extra, lay.per_chip)
    fixed, each = sum(static.values()), sum(per_sample.values())
    largest = max(0, int((capacity - fixed) // each)) if fixed + step_extra <= capacity else 0
    fits = need <= capacity
    suggestion = None
    if not fits and largest:
        fit = batching.split(cfg.global_batch, largest, chips, processes, hosts)
        suggestion = (f"chip_batch={largest} keeps the global batch {cfg.global_batch}: {fit.per_chip} a chip x "
                      f"{fit.accum} accumulation steps (ARGS='chip_batch={largest}', or chip_batch: in the config)")
    return Plan(name, accel, kernel, shp, lay, params["student"] / 1e6,
                {k: v / GIB for k, v in static.items()}, {k: v / GIB for k, v in per_sample.items()},
                step_extra / GIB, need / GIB, capacity / GIB, fits, (capacity - need) / GIB, largest, suggestion,
                cfg.max_steps, step_flops(cfg) if flops else None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make plan", description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--accel", required=True, choices=sorted(ACCELERATORS))
    ap.add_argument("--chips", type=int, default=None, help="chips in all (default: one host's)")
    ap.add_argument("--kernel", choices=sorted(attention.MEMORY), default=None,
                    help="plan with this attention kernel instead of the one the model routes to")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (make ARGS)")
    a = ap.parse_args(argv)
    cfg = config.load(TrainConfig, a.config, a.overrides)
    plan = make_plan(cfg, a.accel, a.chips, name=a.config, kernel=a.kernel, flops=True)
    print("\n".join(plan.lines()))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    cli.run(main)

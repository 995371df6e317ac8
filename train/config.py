"""The pretraining config: plain dataclasses, saved with every checkpoint.

Loaded through octfm.config, so unknown keys are refused by name and `null` stays None.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from octfm.config import FieldError


@dataclasses.dataclass
class DataConfig:
    cache: str = "data/cache"                      # local cache root (after `make stage`)
    splits: list[str] = dataclasses.field(default_factory=lambda: ["train"])
    devices: list[str] | None = None               # None: every device (multi-domain)
    stride: tuple[int, int, int] = (1, 1, 1)       # host-side subsampling of the cached grid
    input_shape: tuple[int, int, int] = (64, 384, 384)  # random crop (D, H, W) fed to the model
    flip_prob: float = 0.5                         # left-right flip (columns)
    # Random-resized crop: per sample and axis, a box of a fraction in [lo, hi] of input_shape is
    # cut at a random place and resized (trilinear) to input_shape, a zoom of 1 to 1/lo; [1, 1]:
    # the plain random crop. Scale jitter for a cache stored at the crop's own size.
    scale: tuple[float, float] = (1.0, 1.0)
    intensity_jitter: float = 0.1                  # device-side gain/offset jitter amplitude
    workers: int | None = None                     # loader processes; None: from this host's cores (data.loader_workers)
    start_method: Literal["spawn", "forkserver"] = "forkserver"
    prefetch_factor: int = 2
    # The training volumes in accelerator memory, cropped there (train/resident.py): "auto" on CUDA
    # when they take at most a fifth of the free memory, "always" on any device (the CPU dry run), "never"
    resident: Literal["auto", "always", "never"] = "auto"

    def __post_init__(self):
        lo, hi = self.scale
        if not (0 < lo <= hi <= 1):
            raise FieldError("scale", f"{list(self.scale)}: needs 0 < lo <= hi <= 1 (fractions of data.input_shape)")


@dataclasses.dataclass
class ModelConfig:
    tubelet: tuple[int, int, int] = (4, 16, 16)
    # Channels of 3 x 3 x 3 convolutions (each + GELU, halving rows and columns) before the tubelet
    # patchify; empty: the plain linear patchify of ViT. A lesion smaller than a tubelet moves
    # inside it, which a linear patchify cannot follow (docs/measurements.md, the learning check).
    stem: tuple[int, ...] = ()
    # max: each token also gets a 1x1x1 projection of every stem channel's peak inside its tubelet
    # (position-invariant detectors: a lesion smaller than a tubelet reads alike wherever it falls).
    stem_pool: Literal["none", "max"] = "none"
    # How tokens pool into the one vector the probes, the online probe, the supervised reference and
    # exported encoders read: the mean, or each channel's max (a cue in a few of hundreds of tokens,
    # such as a handful of lesions, survives a max; a mean dilutes it by the token count).
    pool: Literal["mean", "max"] = "mean"
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    pred_dim: int = 384
    pred_depth: int = 6
    pred_heads: int = 6


@dataclasses.dataclass
class MaskSetConfig:
    """One mask set: `blocks` rectangles in the en-face plane (frames x columns), each
    covering `scale` of it with aspect ratio in `aspect`, spanning the full axial depth."""
    blocks: int = 8
    scale: tuple[float, float] = (0.15, 0.15)
    aspect: tuple[float, float] = (0.75, 1.5)


@dataclasses.dataclass
class MaskConfig:
    sets: list[MaskSetConfig] = dataclasses.field(default_factory=lambda: [
        MaskSetConfig(blocks=8, scale=(0.15, 0.15)), MaskSetConfig(blocks=2, scale=(0.7, 0.7))])
    calibration_samples: int = 256   # masks drawn at start-up to fix the token counts
    # trimmed: the context is a fixed subsample of the visible cells, sized by the 90th percentile
    # of the masked area (the rest of the visible cells is dropped); padded: every visible cell
    # is context, padded to the largest possible count and masked out of attention
    context: Literal["trimmed", "padded"] = "trimmed"
    # each set drawn this many times per sample, every draw scored against the one target-encoder
    # pass of the step (data2vec 2.0's several masks per teacher pass): more context and predictor
    # work per volume read and per target pass
    repeats: int = 1

    def __post_init__(self):
        if self.repeats < 1:
            raise FieldError("repeats", f"{self.repeats}: needs at least 1 (each mask set drawn once)")


@dataclasses.dataclass
class LossConfig:
    """The terms of the pretraining loss and their weights."""
    # Weight of the latent prediction (V-JEPA's term). 0 leaves only the local term: an ablation
    # that says what the latent prediction adds (the predictor then gets zero gradients).
    latent: float = 1.0
    # Weight of the local term: each context token's output also reconstructs (one linear head,
    # L1) statistics (`local_stat`) of its own tubelet's voxels in cells of `local_cell`, so the
    # encoder must keep small bright and dark detail that a latent target may drop
    # (docs/learning-check.md, decision 6). 0: off, and the model has no such head.
    local: float = 0.0
    local_cell: tuple[int, int, int] = (2, 4, 4)
    # What the local term reconstructs per cell: maxmin, each cell's max and min (decision 6: a focus
    # is a bright extreme, a cyst a dark one); mean, each cell's mean (the speckle averaged over the
    # cell's voxels, where a lesion wider than a voxel still shifts it); mean_maxmin, all three
    # (docs/learning-check.md, decision 26).
    local_stat: Literal["maxmin", "mean", "mean_maxmin"] = "maxmin"
    # Weight of the latent term at the context tokens (after V-JEPA 2.1's dense loss on visible
    # tokens): the predictor's outputs at the context positions are also regressed (L1) on the
    # target encoder's features there, so every visible token, not only the masked ones, is asked
    # to carry what the target sees at its own place (docs/learning-check.md, decision 25). 0: off.
    context: float = 0.0


@dataclasses.dataclass
class OptimConfig:
    lr: float = 6e-4
    start_lr: float = 2e-5
    final_lr: float = 1e-6
    warmup_steps: int = 1000
    weight_decay: float = 0.04
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    ema: tuple[float, float] = (0.998, 1.0)   # target-encoder momentum, start -> end
    accum_steps: int = 1
    spike_factor: float = 5.0                 # skip an update whose loss exceeds this x the recent mean
    max_consecutive_skips: int = 100          # this many skipped updates in a row stop the run (exit 1); 0: never


@dataclasses.dataclass
class OnlineProbeConfig:
    """The probe run every `eval_every` steps on the EMA target encoder: k-NN and closed-form
    ridge balanced accuracy on val for each probe task, from a fixed subset of labelled rows."""
    max_train: int = 256                      # labelled train rows (evenly spaced by path; all when fewer)
    max_val: int = 128                        # labelled val rows, likewise
    k: int = 10                               # neighbours of the k-NN vote (cosine, class-balanced)
    ridge: float = 1.0                        # ridge penalty x rows (features standardised); 0: no ridge score
    batch_size: int = 4                       # volumes per forward (the last batch is padded: one XLA graph)
    memory_mb: int = 512                      # keep the cropped inputs in memory when they fit (else re-read)


@dataclasses.dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "octfm"
    mode: Literal["offline", "online"] = "offline"
    entity: str | None = None
    log_checkpoints: bool = False             # each saved checkpoint as a "model" artifact (large for ViT-B)


@dataclasses.dataclass
class TrainConfig:
    name: str = "pretrain"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda", "xla"] = "auto"
    precision: Literal["fp32", "bf16"] = "bf16"
    compile: bool = False                     # torch.compile the student and target (cpu, cuda; XLA compiles anyway)
    batch_size: int = 8                       # per process (per host on XLA SPMD)
    max_steps: int = 10000                    # optimizer updates
    log_every: int = 10
    val_every: int = 0                        # 0: no validation
    val_batches: int = 4
    eval_every: int = 0                       # online probe every this many steps, and at step 0; 0: off
    ckpt_every: int = 1000
    keep_last: int | None = None              # prune older periodic checkpoints; None keeps all
    runs_dir: str = "runs"
    ckpt_dir: str | None = None               # None: <runs_dir>/<name>/checkpoints (local or gs://)
    rankme_tokens: int = 2048
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mask: MaskConfig = dataclasses.field(default_factory=MaskConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    online_probe: OnlineProbeConfig = dataclasses.field(default_factory=OnlineProbeConfig)
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)

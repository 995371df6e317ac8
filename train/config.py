"""The pretraining config: plain dataclasses, saved with every checkpoint. The defaults are the
recipe (docs/recipe.md); a config file states only what differs from them (size, steps, run keys).

Loaded through octfm.config, so unknown keys are refused by name and `null` stays None.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from octfm import config
from octfm.config import ConfigError, FieldError


@dataclasses.dataclass
class DataConfig:
    RENAMED: ClassVar[dict[str, str]] = {"devices": "scanners"}   # read under the old name for one release
    cache: str = "data/cache"                      # local cache root (after `make stage`)
    splits: list[str] = dataclasses.field(default_factory=lambda: ["train"])
    scanners: list[str] | None = None              # the manifest's `device` values kept; None: every scanner
    stride: tuple[int, int, int] = (1, 1, 1)       # host-side subsampling of the cached grid
    input_shape: tuple[int, int, int] = (64, 384, 384)  # random crop (D, H, W) fed to the model
    flip_prob: float = 0.5                         # left-right flip (columns)
    # Random-resized crop: per sample and axis, a box of a fraction in [lo, hi] of input_shape is
    # cut at a random place and resized (trilinear) to input_shape, a zoom of 1 to 1/lo; [1, 1]:
    # the plain random crop. Scale jitter for a cache stored at the crop's own size
    # (docs/recipe.md, Augmentation).
    scale: tuple[float, float] = (0.8, 1.0)
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
    tubelet: tuple[int, int, int] = (4, 16, 16)    # at data.input_shape 64 x 384 x 384: 16 x 24 x 24 = 9,216 tokens
    # Channels of 3 x 3 x 3 convolutions (each + GELU, halving rows and columns) before the tubelet
    # patchify; empty: the plain linear patchify of ViT. A lesion smaller than a tubelet moves
    # inside it, which a linear patchify cannot follow (docs/recipe.md, The encoder).
    stem: tuple[int, ...] = (16,)
    # max: each token also gets a 1x1x1 projection of every stem channel's peak inside its tubelet
    # (position-invariant detectors: a lesion smaller than a tubelet reads alike wherever it falls);
    # none: the patchify alone.
    stem_pool: Literal["none", "max"] = "max"
    # How tokens pool into the one vector the probes, the online probe, the supervised reference and
    # exported encoders read: each channel's max (a cue in a few of hundreds of tokens, such as a
    # handful of lesions, survives a max; a mean dilutes it by the token count), or the mean.
    pool: Literal["mean", "max"] = "max"
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    pred_dim: int = 384
    pred_depth: int = 6
    pred_heads: int = 6                       # head dim 64 (docs/recipe.md, The predictor)


@dataclasses.dataclass
class MaskSetConfig:
    """One mask set: `blocks` rectangles in the en-face plane (frames x columns), each
    covering `scale` of it with aspect ratio in `aspect`, spanning the full axial depth."""
    blocks: int = 8
    scale: tuple[float, float] = (0.15, 0.15)
    aspect: tuple[float, float] = (0.75, 1.5)


@dataclasses.dataclass
class MaskConfig:
    # a short-range set (8 small blocks) and a long-range one (2 large) (docs/recipe.md, Masks)
    sets: list[MaskSetConfig] = dataclasses.field(default_factory=lambda: [
        MaskSetConfig(blocks=8, scale=(0.15, 0.15)), MaskSetConfig(blocks=2, scale=(0.7, 0.7))])
    calibration_samples: int = 256   # masks drawn at start-up to fix the token counts


@dataclasses.dataclass
class LossConfig:
    """The terms of the pretraining loss and their weights (docs/recipe.md, The objective)."""
    # Weight of the local term, beside V-JEPA's latent prediction (weight 1): each context token's output
    # also reconstructs (one linear head, L1) the mean of its own tubelet's voxels in each cell of `local_cell` (the speckle averaged
    # over the cell, where a lesion wider than a voxel still shifts it), so the encoder must keep
    # small detail that a latent target may drop. 0: off, and the model has no such head.
    local: float = 1.0
    local_cell: tuple[int, int, int] = (2, 4, 4)

    def __post_init__(self):
        if self.local < 0:
            raise FieldError("local", f"{self.local:g}: the weight must be at least 0")


@dataclasses.dataclass
class OptimConfig:
    lr: float = 6e-4
    start_lr: float = 2e-5
    final_lr: float = 1e-6
    warmup_steps: int = 1500
    weight_decay: float = 0.04
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    ema: tuple[float, float] = (0.998, 1.0)   # target-encoder momentum, start -> end
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
    # The recipe's batch: volumes per optimizer step, over every process, chip and accumulation step. Each
    # process's share and any gradient accumulation follow from the world size and chip_batch (train/batching.py),
    # alike on TPU, CUDA and CPU: 16 a GPU on a node of 8, 8 a chip on a v4-32 (docs/training.md, The batch).
    global_batch: int = 128
    # The most volumes one chip takes in a forward and backward: `make plan`'s largest batch that fits. None: the
    # global batch in one pass over the chips; set, a global batch beyond chips x chip_batch accumulates gradients.
    chip_batch: int | None = None
    max_steps: int = 30000                    # optimizer updates
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

    def __post_init__(self):
        if self.global_batch < 1:
            raise FieldError("global_batch", f"{self.global_batch}: needs at least 1 volume per optimizer step")
        if self.chip_batch is not None and self.chip_batch < 1:
            raise FieldError("chip_batch", f"{self.chip_batch}: needs at least 1 (or null: no cap)")


BEFORE_V1_TAG = "results-2026-12"  # the last commit before the v1 cut: it reads what earlier code wrote


def before_v1(what: str) -> str:
    """The message for a file written before octfm's v1 cut (checkpoints, their configs, model
    folders): which code reads it."""
    return (f"{what} from before octfm's v1 cut; load it with the tag {BEFORE_V1_TAG} "
            f"(git checkout {BEFORE_V1_TAG})")


def _key_paths(d: dict, prefix: str = "") -> set[str]:
    """The dotted paths of a nested dict's leaves (a list, such as mask.sets, is one leaf)."""
    out: set[str] = set()
    for k, v in d.items():
        out |= _key_paths(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return out


# Research settings removed from the trainer, with the one value it still runs: a checkpoint saved with
# that value loads (the key dropped); one trained with another value is refused, naming the key
RETIRED = {"mask.context": "trimmed", "loss.latent": 1.0}


def _without_retired(saved: dict, uri: str) -> dict:
    """`saved` less the RETIRED keys it holds at their value (a copy); another value is refused."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for path, value in RETIRED.items():
        section, key = path.split(".")
        if key in out.get(section, {}):
            held = out[section].pop(key)
            if held != value:
                raise ConfigError(f"{uri}: a checkpoint trained with {path}={held!r}, a research setting this "
                                  f"trainer no longer has (it runs {value!r}); read it with the octfm that trained it")
    return out


def per_process_batch(saved: dict, world: int = 1) -> dict:
    """A v1 config that stated `batch_size` per process and `optim.accum_steps` restated with the
    global batch they made on `world` processes (what a run saved before the batch became the
    global one); any other config as it is. The batch only sets the data order, not the encoder."""
    if "batch_size" not in saved or "global_batch" in saved:
        return saved
    optim = dict(saved.get("optim", {}))
    accum = int(optim.pop("accum_steps", 1))
    out = {k: v for k, v in saved.items() if k != "batch_size"}
    out.update(global_batch=int(saved["batch_size"]) * accum * int(world), chip_batch=None, optim=optim)
    return out


def saved_config(saved: dict, uri: str, world: int = 1) -> TrainConfig:
    """The TrainConfig a checkpoint at `uri` saved (`world`: the processes that wrote it, which a
    per-process batch of earlier v1 runs is multiplied by: per_process_batch). A checkpoint saves
    every key (config.to_dict), so one whose keys differ from this TrainConfig's was written by
    older code: refused with the tag that reads it, never filled in with today's defaults (a
    missing model.stem would build another encoder than the one whose weights it holds). A
    RETIRED key at its value is dropped."""
    saved = _without_retired(per_process_batch(config.renamed(TrainConfig, saved, where=uri, say=False), world), uri)
    have, want = _key_paths(saved), _key_paths(config.to_dict(TrainConfig()))
    if have != want:
        parts = [f"its config has {', '.join(sorted(have - want))}" if have - want else "",
                 f"lacks {', '.join(sorted(want - have))}" if want - have else ""]
        raise ConfigError(before_v1(f"{uri}: a checkpoint ({'; '.join(p for p in parts if p)})"))
    return config.from_dict(TrainConfig, saved, where=f"{uri} (config)")

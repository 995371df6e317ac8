"""Evaluation settings: the probes `make probe` and `make leaderboard` share (configs/probe.yaml)
and `make finetune`'s (configs/finetune.yaml)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from octfm.config import FieldError
from train.config import WandbConfig


@dataclasses.dataclass
class ProbeConfig:
    RENAMED: ClassVar[dict[str, str]] = {"per_device": "per_scanner", "cross_device": "cross_scanner"}  # one release
    run: str | None = None             # pretraining run folder (runs/<name>): its newest checkpoint
    ckpt: str | None = None            # or an explicit checkpoint (local or gs://); wins over run
    cache: str | None = None           # None: the cache the checkpoint was trained on
    tasks: list[str] = dataclasses.field(default_factory=lambda: ["study_group", "diabetic"])
    heads: list[str] = dataclasses.field(default_factory=lambda: ["linear", "attentive"])
    lrs: list[float] = dataclasses.field(default_factory=lambda: [3e-4, 1e-3, 3e-3])
    weight_decays: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.01, 0.1])
    epochs: int = 60
    batch_size: int = 32
    min_steps: int = 0                 # at least this many optimizer steps: few rows train more epochs (the check's
                                       # label-efficiency curve, docs/recipe.md, Probes); 0: `epochs` whatever the rows
    class_weight: bool = True
    standardize: bool = True           # each feature channel scaled by the training rows' statistics (docs/recipe.md, Probes)
    token_pool: tuple[int, int, int] = (1, 2, 2)   # token grid pooling kept for the attentive probe
    extract_batch: int = 4
    # feature extraction and the probe heads' training; auto: the accelerator when there is one (CUDA, a TPU
    # through torch_xla: the features there, the heads on the CPU), else the CPU (train/runtime.py device_for)
    device: str = "auto"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # feature extraction; auto: bf16 autocast on cuda
    bootstrap: int = 1000
    per_scanner: bool = True           # the test scores on each scanner's volumes alone
    cross_scanner: bool = True         # heads trained on all but one scanner, tested on it (evals/subsets.py)
    baselines: bool = True
    baseline_draws: int = 1            # random-init encoders drawn (init seeds baseline_seed + 1, ...); the learning
                                       # check reads their mean (docs/recipe.md, Probes)
    baseline_seed: int | None = None   # the draws' init seeds start after it; null: `seed`. The learning check sets
                                       # a generated cohort's own
    shuffle_labels: bool = False       # a control: labels permuted across participants
    seed: int = 0
    # `make leaderboard`: at most this many of a run's checkpoints are probed, evenly spaced over its saved
    # steps with the newest always among them (every Nth and the last); 0: every one. Stated before it starts,
    # with the estimated time
    max_checkpoints: int = 8

    def __post_init__(self):
        if self.min_steps < 0:
            raise FieldError("min_steps", f"{self.min_steps} is negative")
        if self.baseline_draws < 1:
            raise FieldError("baseline_draws", f"{self.baseline_draws}; needs at least 1")
        if self.max_checkpoints < 0:
            raise FieldError("max_checkpoints", f"{self.max_checkpoints}: needs 0 (every checkpoint) or more")


@dataclasses.dataclass
class FinetuneConfig:
    """`make finetune` (configs/finetune.yaml): one task, the pretrained encoder trained end to end
    with a probe head, chosen on val, scored on test."""
    RENAMED: ClassVar[dict[str, str]] = {"batch_size": "global_batch"}  # read under the old name for one release
    ckpt: str | None = None            # a pretraining checkpoint or a `make export` model folder (CKPT=...)
    init: Literal["pretrained", "random"] = "pretrained"  # random: the same architecture from scratch, same budget
    cache: str | None = None           # None: the cache the checkpoint was trained on
    out: str | None = None             # run folder; None: runs/finetune_<task>_<init>[_<pct>pct]
    task: str = "diabetic"
    head: Literal["linear", "attentive", "mil"] = "linear"  # the probes' heads (evals/probe_heads.py)
    token_pool: tuple[int, int, int] = (1, 2, 2)         # the attentive head's token grid pooling
    label_fraction: float = 1.0        # of the train participants, stratified by label (evals/subsets.py)
    epochs: int = 80                   # at 40 from scratch stopped short of its plateau (docs/recipe.md, Fine-tuning)
    max_steps: int | None = None       # a budget in optimizer steps whatever label_fraction is: fewer epochs when it ends first
    global_batch: int = 4              # labelled volumes per optimizer step, over all processes (each takes
                                       # global_batch / processes), as pretraining's global_batch
    lr: float = 3.0e-4                 # peak learning rate of the last encoder block
    layer_decay: float = 1.0           # each block below the last: lr x layer_decay once more
    head_lr: float = 1.0e-3
    standardize: bool = True           # the head reads channels standardised by the starting encoder's train-row
                                       # statistics, as the probes' heads do (docs/recipe.md, Fine-tuning); false: not
    weight_decay: float = 0.05         # on weights, not on biases and norms
    warmup_epochs: float = 1.0         # linear warmup, then cosine to 0
    frozen_epochs: int = 5             # head only (encoder frozen, in eval mode) for these first epochs
    class_weight: bool = True          # balanced cross-entropy
    label_smoothing: float = 0.1
    drop_path: float = 0.1             # stochastic depth, 0 at the first block to this at the last
    patience: int = 10                 # stop after this many val scores without a better one (counted after the
                                       # frozen epochs and the warmup); 0: never
    val_every: int = 0                 # optimizer steps between val scores; 0: at the end of each epoch (a batch of
                                       # 128 takes a 10% label fraction's epoch in one or two steps)
    augment: bool = True               # the pretraining crop (data.scale), flip and intensity jitter
    scale: tuple[float, float] | None = None   # None: the encoder's own data.scale
    grad_clip: float = 1.0
    eval_batch: int = 8
    workers: int | None = 2            # loader processes; None: the cores less one, as pretraining (data.loader_workers)
    device: Literal["auto", "cpu", "cuda", "xla"] = "auto"
    precision: Literal["fp32", "bf16"] = "bf16"
    bootstrap: int = 1000
    log_every: int = 10
    seed: int = 0                      # the labelled participants (label_fraction) and, unless train_seed, the training
    train_seed: int | None = None      # the training's randomness alone (random init, head, order, augmentation,
                                       # stochastic depth): several per init on one subset; None: seed
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)

    def __post_init__(self):
        if self.global_batch < 1:
            raise FieldError("global_batch", f"{self.global_batch}: needs at least 1")
        if not 0 < self.label_fraction <= 1:
            raise FieldError("label_fraction", f"{self.label_fraction}: needs 0 < label_fraction <= 1")
        if not 0 < self.layer_decay <= 1:
            raise FieldError("layer_decay", f"{self.layer_decay}: needs 0 < layer_decay <= 1")
        if self.frozen_epochs > self.epochs:
            raise FieldError("frozen_epochs", f"{self.frozen_epochs} is more than epochs={self.epochs}")
        if self.val_every < 0:
            raise FieldError("val_every", f"{self.val_every}: needs 0 (each epoch) or a number of steps")

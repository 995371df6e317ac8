"""The probe settings `make probe` and `make leaderboard` share (configs/probe.yaml)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ProbeConfig:
    run: str | None = None             # pretraining run folder (runs/<name>): its newest checkpoint
    ckpt: str | None = None            # or an explicit checkpoint (local or gs://); wins over run
    cache: str | None = None           # None: the cache the checkpoint was trained on
    tasks: list[str] = dataclasses.field(default_factory=lambda: ["study_group", "diabetic"])
    heads: list[str] = dataclasses.field(default_factory=lambda: ["linear", "attentive"])
    lrs: list[float] = dataclasses.field(default_factory=lambda: [3e-4, 1e-3, 3e-3])
    weight_decays: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.01, 0.1])
    epochs: int = 60
    batch_size: int = 32
    class_weight: bool = True
    token_pool: tuple[int, int, int] = (1, 2, 2)   # token grid pooling kept for the attentive probe
    extract_batch: int = 4
    device: str = "cpu"
    bootstrap: int = 1000
    per_device: bool = True
    cross_device: bool = True
    baselines: bool = True
    shuffle_labels: bool = False       # a control: labels permuted across participants
    seed: int = 0

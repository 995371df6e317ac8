"""The learning check's settings: one typed config (`CheckConfig`), loaded and validated like
TrainConfig (octfm.config: an unknown key is refused by name), and the two sizes it runs at."""
from __future__ import annotations

import dataclasses
from typing import Literal

from check.cohort import COHORT, CUES, DEV_SEED
from octfm.config import FieldError

FRACTIONS = (0.1, 0.25, 1.0)  # of the labelled train participants: the frozen probes' label-efficiency curve
FINETUNE_FRACTIONS = (0.1, 1.0)  # `--finetune`: make finetune from the checkpoint and from random init


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of the check (make learning-check SIZE=...): the production recipe at that size
    (one cohort and cache for all), the fine-tuning recipe's size keys (configs/finetune.yaml is the
    one recipe for both starts and for the references, its from-scratch runs; a GPU's batch of 128
    needs a step budget and val scores by steps), the torch threads of each job run at once
    (Stages.together; 0: torch's default) and how many random-init encoders its random-init rows
    average (docs/recipe.md, Probes)."""
    config: str
    finetune_args: tuple[str, ...] = ()
    threads: int = 1
    random_draws: int = 3


# The CPU size runs its jobs at once too, one thread each: three single-thread processes run 1.5x the steps per
# second of one process on both cores (this model's kernels are too small to use two threads well;
# docs/measurements.md)
SIZES = {"cpu": Size("configs/pretrain_check.yaml", threads=1),
         "gpu": Size("configs/pretrain_check_gpu.yaml",
                     ("global_batch=128", "epochs=100000", "max_steps=3700", "val_every=50", "patience=4", "workers=null"),
                     threads=0, random_draws=5)}


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    """What one `make learning-check` runs (docs/recipe.md, The learning check). The cohort's training
    seeds and random-init draws follow from `seed` alone (learning_check.training_seeds, baseline_seed)."""
    cue: Literal["lesions", "layers", "scanners"] = "lesions"
    size: Literal["cpu", "gpu"] = "cpu"
    source: str | None = None          # an AI-READI-shaped root with labels; None: the generated cohort
    seed: int = DEV_SEED               # the generated cohort's seed (a confirmation takes one never used)
    participants: int = COHORT.participants   # the generated cohort's size
    work: str = "data/learning_check"  # the cohort and its cache
    out: str = "runs/learning_check"   # the runs, and <out>/<cue>/result.*
    config: str | None = None          # the pretraining config; None: the size's (and then its fine-tuning keys)
    overrides: tuple[str, ...] = ()    # pretraining config overrides, key=value (make ARGS)
    bootstrap: int = 1000              # participant resamples of every interval
    probe: tuple[str, ...] = ()        # configs/probe.yaml overrides, after the check's own keys
    random_draws: int | None = None    # random-init encoders whose mean each random-init row reads; None: the size's
    # the label fractions with a supervised reference (make finetune from random init, 80 epochs: 22 min at
    # 10% on one of 2 cores, more than the rest of the check): (): none, the default, which asks whether
    # pretraining learns; (0.1,) also asks the label-efficiency question (--label-efficiency); FRACTIONS is
    # the whole curve (--curve)
    reference_fractions: tuple[float, ...] = ()
    finetune_fractions: tuple[float, ...] = ()   # make finetune from the checkpoint and from random init (--finetune)
    finetune_seeds: int = 1            # training seeds per init and fine-tuning fraction; rows are their mean
    finetune_args: tuple[str, ...] = ()   # configs/finetune.yaml overrides for every fine-tuning run, after the size's
    together: bool = True              # the references, fine-tuning runs and headline tasks each in its own process

    def __post_init__(self):
        if self.random_draws is not None and self.random_draws < 1:
            raise FieldError("random_draws", f"{self.random_draws}; needs at least 1")
        if self.finetune_seeds < 1:
            raise FieldError("finetune_seeds", f"{self.finetune_seeds} (FT_SEEDS); needs at least 1")
        if self.finetune_seeds > 1 and not self.finetune_fractions:
            raise FieldError("finetune_seeds", f"{self.finetune_seeds} (FT_SEEDS) without fine-tuning: add FINETUNE=1")
        off = sorted(set(self.reference_fractions) - set(FRACTIONS))
        if off:
            raise FieldError("reference_fractions", f"{off}: not on the label-efficiency curve {list(FRACTIONS)}")
        if not all(0 < f <= 1 for f in self.finetune_fractions):
            raise FieldError("finetune_fractions", f"{list(self.finetune_fractions)}: each needs 0 < fraction <= 1")
        self._asked_of_the_cue()

    def _asked_of_the_cue(self) -> None:
        """The held-out-scanner protocol trains no supervised reference nor fine-tuning run per fold: a
        flag asking for one is refused by name, not dropped."""
        if CUES[self.cue].protocol == "splits":
            return
        why = f"the {self.cue} cue holds each scanner out in turn and trains no per-fold "
        if self.reference_fractions:
            raise FieldError("reference_fractions", why + "supervised reference: leave out LABELS=1 "
                                                          "(--label-efficiency) and CURVE=1 (--curve)")
        if self.finetune_fractions:
            raise FieldError("finetune_fractions", why + "fine-tuning: leave out FINETUNE=1 (--finetune, "
                                                         "--finetune-fraction) and FT_SEEDS")

    @property
    def pretrain_config(self) -> str:
        return self.config or SIZES[self.size].config

    @property
    def draws(self) -> int:
        """Random-init encoders per random-init row: the config's, or the size's."""
        return self.random_draws or SIZES[self.size].random_draws

    @property
    def tuning_args(self) -> tuple[str, ...]:
        """Every fine-tuning run's overrides: the size's keys (unless `config` names another pretraining
        config), then finetune_args."""
        return (*(SIZES[self.size].finetune_args if self.config is None else ()), *self.finetune_args)

    @property
    def threads(self) -> int | None:
        """Torch threads of each job run at once (Stages.together); None: one job after another."""
        return SIZES[self.size].threads if self.together else None

"""The run folder (runs/<name>): the one owner of its file names (docs/architecture.md,
"On-disk contracts"). `make pretrain` writes config.yaml, metrics.jsonl, curves.png and
checkpoints/; `make probe` and `make leaderboard` write probe/, leaderboard.* and
best_checkpoint.json; `make embed` writes embeddings.parquet; `make report` writes report.html;
`make finetune` writes finetune.json, metrics.jsonl, checkpoints/ (with best.pt) and <task>/."""
from __future__ import annotations

from pathlib import Path

import yaml

from octfm import fsio

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
PROBE = "probe"
BEST = "best_checkpoint.json"
REPORT = "report.html"
FINETUNE = "finetune.json"           # `make finetune`: its settings; checkpoints/best.pt its best epoch
FINETUNED = "best.pt"
EMBEDDINGS = "embeddings.parquet"    # `make embed`: one row per cached volume, its pooled embedding
LEADERBOARD = "leaderboard"          # leaderboard.parquet, .md, .png; probe/leaderboard/step_<N>.json


class RunFolder:
    """Paths inside one run folder."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    config = property(lambda self: self.root / CONFIG)
    metrics = property(lambda self: self.root / METRICS)
    curves = property(lambda self: self.root / CURVES)
    probe = property(lambda self: self.root / PROBE)
    features = property(lambda self: self.root / PROBE / "features")
    best_checkpoint = property(lambda self: self.root / BEST)
    report = property(lambda self: self.root / REPORT)
    embeddings = property(lambda self: self.root / EMBEDDINGS)
    finetune = property(lambda self: self.root / FINETUNE)
    stored_results_dir = property(lambda self: self.root / PROBE / LEADERBOARD)

    def checkpoints(self) -> str:
        """Where the run keeps its checkpoints: its config's `ckpt_dir` (e.g. gs://), else <run>/checkpoints."""
        ckpt_dir = yaml.safe_load(self.config.read_text()).get("ckpt_dir") if self.config.exists() else None
        return ckpt_dir or fsio.join(str(self.root), CHECKPOINTS)

    def finetuned(self) -> str:
        """A fine-tuning run's best epoch (a checkpoint every stage reads)."""
        return fsio.join(self.checkpoints(), FINETUNED)

    def probe_task(self, task: str) -> Path:
        return self.probe / task

    def stored_result(self, step: int) -> Path:
        """A checkpoint's stored leaderboard result."""
        return self.stored_results_dir / f"step_{step:07d}.json"


def default_checkpoints(run_dir: str | Path) -> str:
    """<run>/checkpoints, for a run whose config sets no `ckpt_dir`."""
    return fsio.join(str(run_dir), CHECKPOINTS)


def leaderboard_file(out_dir: str | Path, ext: str) -> Path:
    """leaderboard.<ext> (parquet, md, png) in the folder the table goes to."""
    return Path(out_dir) / f"{LEADERBOARD}.{ext}"

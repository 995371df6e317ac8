"""The run folder (runs/<name>): the one owner of its file names (docs/architecture.md,
"On-disk contracts"). `make pretrain` writes config.yaml, metrics.jsonl, curves.png and
checkpoints/; `make probe` and `make leaderboard` write probe/, leaderboard.* and
best_checkpoint.json; `make embed` writes embeddings.parquet; `make report` writes report.html;
`make finetune` writes finetune.json, metrics.jsonl, checkpoints/ (with best.pt) and <task>/.

A run whose `ckpt_dir` is elsewhere (gs://, as a TPU run keeps them) also gets copies of its
config.yaml and metrics.jsonl there (`publish`), so that folder alone is a run the evaluation
commands take (`RUN=gs://...`): they read its checkpoints there and write what they make into the
local folder runs/<name> (`local_folder`)."""
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


def is_remote_run(run: str | Path) -> bool:
    return fsio.is_remote(str(run))


def stored_config(run: str | Path) -> dict | None:
    """The run's config.yaml (local or gs://) as a dict; None when it has none."""
    try:
        return yaml.safe_load(fsio.read_text(fsio.join(str(run), CONFIG)))
    except FileNotFoundError:
        return None


def checkpoint_dir(run: str | Path) -> str:
    """Where a run (a local run folder, or a gs:// folder as a TPU run leaves it) keeps its
    checkpoints: its config's `ckpt_dir`; else a local run's checkpoints/, and a gs:// folder
    itself, unless it holds no step file and a checkpoints/ folder does (runs_dir on gs://)."""
    if not is_remote_run(run):
        return RunFolder(run).checkpoints()
    cfg = stored_config(run) or {}
    if cfg.get("ckpt_dir"):
        return cfg["ckpt_dir"]
    run = str(run).rstrip("/")
    nested = fsio.join(run, CHECKPOINTS)
    fs, path = fsio.filesystem(run)
    holds_steps = any(p.rsplit("/", 1)[-1].startswith("step_") for p in fs.ls(path, detail=False)) \
        if fs.exists(path) else False
    return nested if not holds_steps and fsio.exists(nested) else run


def local_folder(run: str | Path, runs_dir: str = "runs") -> Path:
    """The local folder an evaluation of `run` writes into: the run folder itself, or for a gs://
    run runs/<name> (its config's runs_dir and name; without a config, the folder's last part)."""
    if not is_remote_run(run):
        return Path(run)
    cfg = stored_config(run) or {}
    return Path(cfg.get("runs_dir") or runs_dir) / (cfg.get("name") or str(run).rstrip("/").rsplit("/", 1)[-1])


def publish(run_dir: str | Path, ckpt_dir: str, *names: str) -> None:
    """Copies of the run folder's `names` (config.yaml, metrics.jsonl) into `ckpt_dir` when the
    checkpoints are kept outside the run folder, so that folder alone is a run evaluation reads."""
    if ckpt_dir == default_checkpoints(run_dir):
        return
    for name in names:
        src = Path(run_dir) / name
        if src.exists():
            fsio.atomic_write_bytes(fsio.join(ckpt_dir, name), src.read_bytes())


def default_checkpoints(run_dir: str | Path) -> str:
    """<run>/checkpoints, for a run whose config sets no `ckpt_dir`."""
    return fsio.join(str(run_dir), CHECKPOINTS)


def leaderboard_file(out_dir: str | Path, ext: str) -> Path:
    """leaderboard.<ext> (parquet, md, png) in the folder the table goes to."""
    return Path(out_dir) / f"{LEADERBOARD}.{ext}"

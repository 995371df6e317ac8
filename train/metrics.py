"""Collapse monitors, the XLA compilation count, and the metrics sink (metrics.jsonl always, W&B from rank 0
when enabled)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from octfm import fsio
from train.run_folder import METRICS, RunFolder


@torch.no_grad()
def rankme(features: torch.Tensor, max_tokens: int = 2048, eps: float = 1e-7) -> float:
    """RankMe effective rank: exp(entropy) of the normalised singular values of a
    [n, d] feature matrix (Garrido et al. 2023). Collapse drives it towards 1.

    The singular values come from the d x d Gram matrix, reduced on the device: only that
    small replicated matrix crosses to the host (moving batch-sharded features to the host
    under XLA SPMD would compile an unsharding program at every log step)."""
    f = features.reshape(-1, features.shape[-1]).float()
    if f.shape[0] > max_tokens:
        idx = torch.linspace(0, f.shape[0] - 1, max_tokens).long().to(f.device)
        f = f.index_select(0, idx)
    gram = (f.T @ f).cpu().double()
    s = torch.linalg.eigvalsh(gram).clamp(min=0).sqrt()
    p = s / (s.sum() + eps) + eps
    return float(torch.exp(-(p * p.log()).sum()))


@torch.no_grad()
def feature_std(features: torch.Tensor) -> float:
    """Mean over channels of the std across samples and tokens (near 0 means collapse)."""
    f = features.reshape(-1, features.shape[-1]).float()
    return float(f.std(dim=0).mean())


def xla_compiles() -> dict:
    """Compilation count and seconds so far (torch_xla.debug.metrics), for metrics.jsonl."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    count, total = (data[0], data[1]) if data else (0, 0.0)
    return {"xla_compiles": int(count), "xla_compile_s": round(total / 1e9, 3)}


def read_splits(run_dir: str | Path) -> dict[str, dict[int, dict]]:
    """metrics.jsonl as {split: {step: record}} (splits: train, val, probe) of a run folder, local
    or gs:// (the copy a run with its checkpoints there keeps: train/run_folder.py publish); a
    resumed run rewrites steps, so the last record of a step wins. Empty when the file is
    missing; a line cut short by a kill or a full disk is skipped."""
    out: dict[str, dict[int, dict]] = {}
    try:
        text = fsio.read_bytes(fsio.join(str(run_dir), METRICS)).decode(errors="replace")
    except FileNotFoundError:
        text = ""
    if text:
        for line in text.splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and "step" in r:
                out.setdefault(r.get("split", "train"), {})[r["step"]] = r
    return out


def read_metrics(run_dir: str | Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """The train and val records of metrics.jsonl ({step: record} each), as read_splits."""
    s = read_splits(run_dir)
    return s.get("train", {}), s.get("val", {})


class MetricsLog:
    """Append-only metrics.jsonl (rank 0), mirrored to W&B under train/, val/ and probe/ when enabled:
    W&B keys are `<split>/<jsonl key>`, so a curve has one name everywhere. The run's config
    goes to W&B as its config; checkpoints optionally as "model" artifacts."""

    def __init__(self, run_dir: Path, enabled: bool, wandb_cfg=None, config: dict | None = None):
        self.enabled = enabled
        self.path = RunFolder(run_dir).metrics
        self.wandb = None
        self.log_checkpoints = wandb_cfg is not None and wandb_cfg.log_checkpoints
        if enabled and wandb_cfg is not None and wandb_cfg.enabled:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, mode=wandb_cfg.mode,
                                    dir=str(run_dir), config=config, name=Path(run_dir).name, resume="allow",
                                    id=Path(run_dir).name)

    def log(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"split": prefix, **clean}) + "\n")
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in record.items() if k != "step"}, step=record.get("step"))

    def log_checkpoint(self, uri: str | None, step: int) -> None:
        """Record a saved checkpoint as a W&B "model" artifact (aliases step_<N> and latest).
        A gs:// checkpoint is recorded by reference (no second upload, no read back)."""
        if self.wandb is None or not self.log_checkpoints or not uri:
            return
        import wandb

        from octfm import fsio

        art = wandb.Artifact(f"{self.wandb.name}-checkpoint", type="model", metadata={"step": step})
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        if fsio.is_remote(uri):
            art.add_reference(uri, name=name, checksum=False)
        else:
            art.add_file(uri, name=name)
        self.wandb.log_artifact(art, aliases=[f"step_{step}", "latest"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()

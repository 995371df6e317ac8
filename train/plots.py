"""Training curves from metrics.jsonl as one PNG (loss, LR, grad norm, collapse monitors)."""
from __future__ import annotations

from pathlib import Path

from train.metrics import read_metrics


def plot_metrics(run_dir: str | Path) -> Path | None:
    run_dir = Path(run_dir)
    train, val = read_metrics(run_dir)
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(train)
    panels = [("loss", "L1 loss"), ("lr", "learning rate"), ("grad_norm", "grad norm (pre-clip)"),
              ("rankme", "RankMe of targets"), ("target_std", "target feature std"), ("data_wait_frac", "data wait")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(steps, [train[s].get(key) for s in steps], label="train")
        if key == "loss" and val:
            vs = sorted(val)
            ax.plot(vs, [val[s]["loss"] for s in vs], "o-", label="val")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out

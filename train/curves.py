"""Training curves from metrics.jsonl as one PNG: loss, schedules, grad norm, collapse
monitors, throughput and data wait (the same figure in curves.png and in `make report`)."""
from __future__ import annotations

from pathlib import Path

from octfm.plots import pyplot, to_png
from train.metrics import read_metrics
from train.run_folder import RunFolder

# (metrics.jsonl key, panel title): the names W&B shows under train/ too
PANELS = [("loss", "L1 loss"), ("lr", "learning rate"), ("grad_norm", "grad norm (pre-clip)"),
          ("ema_momentum", "EMA momentum"), ("rankme", "RankMe of targets"), ("target_std", "target feature std"),
          ("samples_per_s", "throughput (samples/s)"), ("data_wait_frac", "data wait fraction")]


def curves_png(records: tuple[dict[int, dict], dict[int, dict]], title: str, dpi: int = 80) -> bytes | None:
    """The curves figure for read_metrics' (train, val) records as PNG bytes, or None when
    there are no training rows."""
    train, val = records
    if not train:
        return None
    plt = pyplot()
    steps = sorted(train)
    fig, axes = plt.subplots(2, 4, figsize=(17, 6.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        ys = [train[s].get(key) for s in steps]
        ys = [float("nan") if y is None else y for y in ys]  # non-finite values are logged as null
        ax.plot(steps, ys, ".-" if len(steps) < 30 else "-", label="train")
        if key == "loss" and val:
            vs = sorted(val)
            ax.plot(vs, [val[s]["loss"] for s in vs], "o-", label="val")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return to_png(fig, dpi)


def plot_metrics(run_dir: str | Path) -> Path | None:
    """Write <run_dir>/curves.png; None when there is nothing to plot."""
    png = curves_png(read_metrics(run_dir), Path(run_dir).name)
    if png is None:
        return None
    out = RunFolder(run_dir).curves
    out.write_bytes(png)
    return out

"""Training curves as PNGs: pretraining's from metrics.jsonl (loss, schedules, grad norm, collapse
monitors, throughput, data wait and the online probe; the same figure in curves.png and in
`make report`), and a fine-tuning run's train loss and val score per epoch."""
from __future__ import annotations

from pathlib import Path

from octfm.plots import pyplot, save_png, to_png
from train.metrics import read_splits
from train.run_folder import RunFolder

# (metrics.jsonl key, panel title): the names W&B shows under train/ too
PANELS = [("loss", "L1 loss"), ("lr", "learning rate"), ("grad_norm", "grad norm (pre-clip)"),
          ("ema_momentum", "EMA momentum"), ("rankme", "RankMe of targets"), ("target_std", "target feature std"),
          ("samples_per_s", "throughput (samples/s)"), ("data_wait_frac", "data wait fraction")]


def probe_panel(ax, probe: dict[int, dict]) -> None:
    """The online probe's val balanced accuracy per task against the step (k-NN solid, ridge
    dashed); step 0 is the random-init encoder, the floor of every curve."""
    steps = sorted(probe)
    keys = sorted({k for r in probe.values() for k in r if k.endswith(("/knn_bal_acc", "/ridge_bal_acc"))})
    for key in keys:
        ys = [float("nan") if probe[s].get(key) is None else probe[s][key] for s in steps]
        ax.plot(steps, ys, "o-" if key.endswith("knn_bal_acc") else "s--", label=key.replace("_bal_acc", ""))
    if keys:
        ax.legend(fontsize=7)


def curves_png(splits: dict[str, dict[int, dict]], title: str, dpi: int = 80) -> bytes | None:
    """The curves figure for read_splits' records (train, val, probe) as PNG bytes, or None
    when there are no training rows."""
    train, val, probe = (splits.get(k, {}) for k in ("train", "val", "probe"))
    if not train:
        return None
    plt = pyplot()
    steps = sorted(train)
    fig, axes = plt.subplots(3, 3, figsize=(15, 9.5))
    for ax, (key, panel) in zip(axes.flat, PANELS):
        ys = [train[s].get(key) for s in steps]
        ys = [float("nan") if y is None else y for y in ys]  # non-finite values are logged as null
        ax.plot(steps, ys, ".-" if len(steps) < 30 else "-", label="train")
        if key == "loss" and val:
            vs = sorted(val)
            ax.plot(vs, [val[s]["loss"] for s in vs], "o-", label="val")
            ax.legend()
        ax.set_title(panel)
    probe_panel(axes.flat[len(PANELS)], probe)
    axes.flat[len(PANELS)].set_title("online probe: val balanced accuracy")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return to_png(fig, dpi)


def plot_metrics(run_dir: str | Path) -> Path | None:
    """Write <run_dir>/curves.png; None when there is nothing to plot."""
    png = curves_png(read_splits(run_dir), Path(run_dir).name)
    if png is None:
        return None
    out = RunFolder(run_dir).curves
    out.write_bytes(png)
    return out


def plot_history(history: list[dict], path: Path, title: str) -> None:
    """A fine-tuning run's train loss and val balanced accuracy per epoch (evals/finetune.py)."""
    if not history:
        return
    plt = pyplot()
    ep = [h["epoch"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(ep, [h["loss"] for h in history], "o-")
    a.set_title("train loss (epoch mean)")
    b.plot(ep, [h["balanced_accuracy"] for h in history], "o-")
    b.set_title("val balanced accuracy")
    for ax in (a, b):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save_png(fig, path, dpi=80)

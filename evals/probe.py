"""`make probe CONFIG=configs/probe.yaml [CKPT=...]`: frozen-encoder probes for diabetes status.

Features are extracted once per checkpoint and cache (kept under the run's probe folder);
a grid of heads (evals/probe_heads.py) trains from them in seconds, is chosen on val and
reported on test, with participant-level bootstrap intervals, per-device results,
cross-device transfer, and the same probes on a random encoder plus a majority predictor.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd

from evals import features
from evals.config import ProbeConfig
from evals import probe_metrics as pm
from evals import probe_heads
from evals.probe_heads import HeadGrid, train_heads
from manifests.aireadi import TASKS
from manifests.splits import split_leaks
from octfm import cli, config, plots
from train import checkpoint, data, run_folder, runtime, shares
from train.run_folder import RunFolder

def run_checkpoint_dir(run: str) -> str:
    """A run's checkpoint folder: a local run folder's, or a gs:// run's (train/run_folder.py)."""
    return run_folder.checkpoint_dir(run)


def heads_device(device: str) -> str:
    """Where the probe heads train: `device` (auto resolved), except a TPU's, whose many small
    graphs the CPU runs sooner (fine-tuning fits its head there too); the heads train alike anywhere."""
    dev = runtime.device_for(device)
    return "cpu" if dev.startswith("xla") else dev


def resolve_checkpoint(cfg: ProbeConfig) -> str:
    if cfg.ckpt:
        return cfg.ckpt
    if cfg.run:
        ckpt_dir = run_checkpoint_dir(cfg.run)
        uri = checkpoint.newest_whole(ckpt_dir)
        if uri:
            return uri
        raise cli.UsageError(f"run: no checkpoint under {ckpt_dir}")
    raise cli.UsageError("probe config: set `run` (a pretraining run folder) or `ckpt` (or CKPT=...)")


PROBED_SPLITS = ("train", "val", "test")


def labelled_rows(cache: str, seed: int, shuffle: bool) -> list[dict]:
    """Cached ok volumes with a label and a split (what probe features are extracted for),
    checked: no participant may sit in two splits (a probe trained on one of them would be
    tested on them too)."""
    rows = data.select_rows(cache, PROBED_SPLITS, None, labelled=True)
    leaks = split_leaks(pd.DataFrame(rows))
    if leaks:
        raise cli.UsageError(f"{cache}: participants in more than one split: {leaks[:10]}")
    if shuffle:  # permute labels across participants (keeps each participant's rows together)
        people = sorted({r["participant_id"] for r in rows})
        labels = {r["participant_id"]: r["label"] for r in rows}
        perm = np.random.default_rng(seed).permutation(len(people))
        new = {p: labels[people[j]] for p, j in zip(people, perm)}
        rows = [{**r, "label": new[r["participant_id"]]} for r in rows]
    return rows


def rows_fingerprint(rows: list[dict]) -> str:
    """What the probe results depend on in the cache: volumes, labels, splits, participants, scanners."""
    blob = [(r["relpath"], r["cache_key"], r["label"], r["split"], r["participant_id"], r["device"]) for r in rows]
    return config.content_key(blob, 20)  # a list of tuples: sorting keys leaves its bytes as before


def val_rank(balanced_accuracy, auroc) -> tuple[float, float]:
    """The order heads and checkpoints are chosen by: val balanced accuracy, then val AUROC
    (an undefined score ranks last). Only val scores ever reach it."""
    return float(np.nan_to_num(balanced_accuracy, nan=-1)), float(np.nan_to_num(auroc, nan=-1))


def fraction_steps(cfg: ProbeConfig, full_train: np.ndarray) -> int:
    """The optimizer steps a label fraction's heads train on a fold: those `epochs` take on the
    fold's full train rows, or `min_steps` where more (docs/recipe.md, Probes)."""
    return max(cfg.min_steps, cfg.epochs * math.ceil(int(full_train.sum()) / cfg.batch_size))


class GridFit(NamedTuple):
    heads: HeadGrid           # every head of the grid, trained
    grid: list                # (lr, weight decay) per head
    probs: np.ndarray         # [H, n, C] every head's probabilities for every row
    best: int                 # the head val ranks first (val_rank)
    val: tuple[float, float]  # its val balanced accuracy and AUROC


def fit_grid(kind, cfg: ProbeConfig, feats, y, split, classes, train_mask=None, val_mask=None) -> GridFit:
    """Train the lr x wd grid on train; rank its heads on val."""
    return fit_grids(kind, cfg, [feats], y, split, classes, train_mask, val_mask)[0]


def fit_grids(kind, cfg: ProbeConfig, feats: list[dict], y, split, classes, train_mask=None,
              val_mask=None) -> list[GridFit]:
    """fit_grid for several encoders' features of the same rows: their grids train as one stack
    (train_heads), each as it would alone, in fewer and larger steps (the learning check's
    pretrained encoder and random-init draws)."""
    grid = [(lr, wd) for lr in cfg.lrs for wd in cfg.weight_decays]
    tr = (split == "train") if train_mask is None else train_mask
    va = (split == "val") if val_mask is None else val_mask
    one = len(feats) == 1
    pooled = [f["pooled"] for f in feats]
    tokens = [f["tokens"].astype(np.float32) for f in feats] if probe_heads.reads_tokens(kind) else None

    def arg(xs, rows=slice(None)):  # one encoder's array as it is, several as a list (train_heads)
        if xs is None:
            return None
        return xs[0][rows] if one else [x[rows] for x in xs]
    heads = train_heads(kind, grid, arg(pooled, tr), arg(tokens, tr), y[tr], classes, cfg.epochs, cfg.batch_size,
                        cfg.seed, cfg.class_weight, standardize=cfg.standardize, device=heads_device(cfg.device),
                        min_steps=cfg.min_steps)
    every = heads(arg(pooled), arg(tokens))                                    # [E x H, n, C]
    out = []
    for e in range(len(feats)):
        probs = every[e * len(grid):(e + 1) * len(grid)]
        scores = [(pm.balanced_accuracy(y[va], probs[h][va].argmax(1), classes), pm.macro_auroc(y[va], probs[h][va]))
                  for h in range(len(grid))]
        best = max(range(len(grid)), key=lambda h: val_rank(*scores[h]))
        out.append(GridFit(heads if one else heads.encoder(e), grid, probs, best, scores[best]))
    return out


def fit_and_select(kind, cfg: ProbeConfig, feats, y, split, classes, train_mask=None, val_mask=None):
    """Train the lr x wd grid on train, pick the best head on val balanced accuracy."""
    return fit_and_select_all(kind, cfg, [feats], y, split, classes, train_mask, val_mask)[0]


def fit_and_select_all(kind, cfg: ProbeConfig, feats: list[dict], y, split, classes, train_mask=None,
                       val_mask=None) -> list[tuple[dict, np.ndarray]]:
    """fit_and_select for each of several encoders' features, their grids trained as one (fit_grids)."""
    return [({"lr": f.grid[f.best][0], "weight_decay": f.grid[f.best][1], "val_balanced_accuracy": f.val[0],
              "val_auroc": f.val[1]}, f.probs[f.best])
            for f in fit_grids(kind, cfg, feats, y, split, classes, train_mask, val_mask)]


def evaluate(prob, y, groups, mask, classes, cfg) -> dict:
    out = pm.summary(y[mask], prob[mask], classes)
    out.update(pm.bootstrap_ci(y[mask], prob[mask], groups[mask], classes, cfg.bootstrap, cfg.seed))
    return out


def probe_task(task: str, cfg: ProbeConfig, rows, feats_by_encoder: dict, out_dir: Path | None) -> dict:
    """Every head on every encoder for one task, chosen on val and evaluated on val and test
    (overall and per test device); writes the task's report when out_dir is given."""
    spec = TASKS[task]
    k = spec["classes"]
    y = np.array([spec["map"](r["label"]) for r in rows])
    split = np.array([r["split"] for r in rows])
    groups = np.array([r["participant_id"] for r in rows])
    scanners = np.array([r["device"] for r in rows])
    test = split == "test"
    result: dict = {"task": task, "classes": spec["names"], "counts": {s: np.bincount(y[split == s], minlength=k).tolist()
                                                                        for s in ("train", "val", "test")},
                    "probes": [], "per_scanner": {}, "cross_scanner": None,
                    "standardize": cfg.standardize}  # channels scaled by the training rows' statistics (docs/recipe.md, Probes)
    best = None  # (val rank, head, probabilities) of the pretrained encoder's head chosen on val: the plots
    names = list(feats_by_encoder)
    fitted = {(name, kind): fit  # each kind's heads of every encoder trained as one stack (fit_grids)
              for kind in cfg.heads for name, fit in zip(names, fit_and_select_all(
                  kind, cfg, [feats_by_encoder[n] for n in names], y, split, k))}
    for enc_name in names:
        for kind in cfg.heads:
            chosen, prob = fitted[enc_name, kind]
            res = {"encoder": enc_name, "head": kind, **chosen, "val": evaluate(prob, y, groups, split == "val", k, cfg),
                   "test": evaluate(prob, y, groups, test, k, cfg)}
            result["probes"].append(res)
            rank = val_rank(chosen["val_balanced_accuracy"], chosen["val_auroc"])
            if enc_name == "pretrained" and (best is None or rank > best[0]):
                best = (rank, kind, prob)
            if cfg.per_scanner and enc_name == "pretrained":
                result["per_scanner"][kind] = {d: evaluate(prob, y, groups, test & (scanners == d), k, cfg)
                                              for d in sorted(set(scanners[test]))}
    majority = np.bincount(y[split == "train"], minlength=k).argmax()
    mprob = np.eye(k)[np.full(len(y), majority)]
    result["probes"].append({"encoder": "none", "head": "majority_class", "test": evaluate(mprob, y, groups, test, k, cfg)})
    if cfg.cross_scanner and "pretrained" in feats_by_encoder:
        result["cross_scanner"] = cross_scanner(cfg, feats_by_encoder["pretrained"], y, split, scanners, k)
    if best is not None:
        result["plotted_head"] = best[1]
    if out_dir is not None:
        write_report(result, out_dir, y[test], best[2][test] if best is not None else None)
    return result


def cross_scanner(cfg, feats, y, split, scanners, k) -> dict:
    """Balanced accuracy of a linear probe trained (and chosen) on one scanner, tested on each."""
    out = {}
    for src in sorted(set(scanners)):
        tr, va = (split == "train") & (scanners == src), (split == "val") & (scanners == src)
        if len(set(y[tr])) < 2 or va.sum() == 0:
            continue
        _, prob = fit_and_select("linear", cfg, feats, y, split, k, tr, va)
        out[src] = {dst: pm.balanced_accuracy(y[(split == "test") & (scanners == dst)],
                                              prob[(split == "test") & (scanners == dst)].argmax(1), k)
                    for dst in sorted(set(scanners[split == "test"]))}
    return out


def write_report(result: dict, out_dir: Path, y_test, prob_test) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2, default=float))
    lines = [f"# Probe: {result['task']} ({', '.join(result['classes'])})", "",
             f"Rows per class: train {result['counts']['train']}, val {result['counts']['val']}, "
             f"test {result['counts']['test']}. Intervals: 95% bootstrap over participants.", "",
             "| encoder | head | lr | wd | val bal. acc | test bal. acc | test AUROC (macro OvR) | entropy | collapsed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in result["probes"]:
        t = p["test"]
        lines.append(f"| {p['encoder']} | {p['head']} | {p.get('lr', '')} | {p.get('weight_decay', '')} | "
                     f"{cli.fmt_number(p.get('val_balanced_accuracy'))} | {cli.fmt_number(t['balanced_accuracy'], t['balanced_accuracy_ci95'])} | "
                     f"{cli.fmt_number(t['auroc_macro_ovr'], t['auroc_macro_ovr_ci95'])} | {t['prediction_entropy']:.3f} | "
                     f"{'YES' if t['collapsed'] else 'no'} |")
    for kind, per in result["per_scanner"].items():
        lines += ["", f"Per device (pretrained, {kind}, test):", "", "| device | n | bal. acc | AUROC |", "|---|---|---|---|"]
        lines += [f"| {d} | {m['n']} | {cli.fmt_number(m['balanced_accuracy'], m.get('balanced_accuracy_ci95'))} | "
                  f"{cli.fmt_number(m['auroc_macro_ovr'], m.get('auroc_macro_ovr_ci95'))} |" for d, m in per.items()]
    if result["cross_scanner"]:
        dsts = sorted({d for row in result["cross_scanner"].values() for d in row})
        lines += ["", "Cross-device transfer (linear, balanced accuracy; rows: trained on, columns: tested on):", "",
                  "| train \\ test | " + " | ".join(dsts) + " |", "|---" * (len(dsts) + 1) + "|"]
        lines += [f"| {s} | " + " | ".join(cli.fmt_number(row.get(d)) for d in dsts) + " |" for s, row in result["cross_scanner"].items()]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    if prob_test is not None and len(y_test):
        plot(out_dir, result, y_test, prob_test)


def plot(out_dir: Path, result: dict, y, prob) -> None:
    plt = plots.pyplot()
    k = prob.shape[1]
    names = result["classes"]
    cm = pm.confusion(y, prob.argmax(1), k)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.imshow(cm, cmap="Blues")
    for i in range(k):
        for j in range(k):
            ax.text(j, i, str(cm[i, j]), ha="center", va="center")
    short = [n[:14] for n in names]
    ax.set_xticks(range(k), short, rotation=30, ha="right")
    ax.set_yticks(range(k), short)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"{result['task']}: pretrained, {result['plotted_head']} head (chosen on val), test", fontsize=9)
    fig.tight_layout()
    plots.save_png(fig, out_dir / "confusion.png", dpi=90)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for c in (range(k) if k > 2 else [1]):
        yc = (y == c).astype(int)
        if 0 < yc.sum() < len(yc):
            order = np.argsort(-prob[:, c])
            tpr = np.concatenate([[0], np.cumsum(yc[order]) / yc.sum()])
            fpr = np.concatenate([[0], np.cumsum(1 - yc[order]) / (len(yc) - yc.sum())])
            ax.plot(fpr, tpr, label=f"{short[c]} (AUROC {pm.binary_auroc(yc, prob[:, c]):.2f})")
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.legend(fontsize=8)
    ax.set_title(f"{result['task']}: ROC (one vs rest), {result['plotted_head']} head, test", fontsize=9)
    fig.tight_layout()
    plots.save_png(fig, out_dir / "roc.png", dpi=90)


def check_tasks(cfg: ProbeConfig) -> None:
    unknown = [t for t in cfg.tasks if t not in TASKS]
    if unknown:
        raise cli.UsageError(f"tasks: unknown task {unknown[0]!r} (known: {', '.join(TASKS)})")
    unknown = [h for h in cfg.heads if h not in probe_heads.HEADS]
    if unknown:
        raise cli.UsageError(f"heads: unknown head kind {unknown[0]!r} (known: {', '.join(probe_heads.HEADS)})")


RANDOM_INIT = "random_init"


def random_draw(draw: int) -> str:
    """The features' name of random-init draw `draw` (1-based; init seed draw_seeds' `draw`-th): the first
    keeps the name it had when there was one."""
    return RANDOM_INIT if draw == 1 else f"{RANDOM_INIT}_{draw}"


def draw_seeds(cfg: ProbeConfig) -> list[int]:
    """The init seeds of the random-init draws: baseline_seed (null: the probes' seed) + 1, ..., +
    baseline_draws (draw 1 is the encoder the probes read when there was one)."""
    base = cfg.seed if cfg.baseline_seed is None else cfg.baseline_seed
    return [base + draw for draw in range(1, cfg.baseline_draws + 1)]


def random_draws(feats: dict) -> list[str]:
    """The random-init draws among the features, in draw order."""
    names, draw = [], 1
    while random_draw(draw) in feats:
        names.append(random_draw(draw))
        draw += 1
    return names


def checkpoint_features(cfg: ProbeConfig, ckpt: str, probe_dir: Path | None = None, state: dict | None = None,
                        grids: Sequence[str] = ()) -> dict:
    """The labelled rows and the features of the checkpoint's encoder and, with `baselines`, of
    `baseline_draws` random-init ones of the same architecture, extracted once and kept under <probe_dir>/features.
    `state`: the checkpoint already loaded by a caller that reads more of it (loaded once).
    `grids`: encoders whose full token grids are also kept there (encoder_features)."""
    check_tasks(cfg)
    enc, tcfg, ident = features.checkpoint_encoder(ckpt, state=state)
    encoders = {"pretrained": (enc, ident)}
    for draw, seed in enumerate(draw_seeds(cfg) if cfg.baselines else (), 1):
        r_enc, _, r_ident = features.checkpoint_encoder(None, seed=seed, train_cfg=tcfg)
        encoders[random_draw(draw)] = (r_enc, r_ident)
    return {**encoder_features(cfg, encoders, tcfg, probe_dir, grids), "step": ident["step"]}


def encoder_features(cfg: ProbeConfig, encoders: dict, tcfg, probe_dir: Path | None = None,
                     grids: Sequence[str] = ()) -> dict:
    """The labelled rows and the features of named encoders ({name: (encoder, identity)}) of one
    architecture (`tcfg`, whose cache they read unless `cache` is set): those kept under
    <probe_dir>/features are loaded, the others extracted in one pass over the cache (each batch read once).
    `grids`: encoders whose full token grids (features.grid_key, what the token probe reads) are
    written there too in the same pass, not returned (the learning check's token probe then reads
    no volume again)."""
    check_tasks(cfg)
    cache = cfg.cache or shares.whole_cache(tcfg.data.cache, "probe")
    rows = labelled_rows(cache, cfg.seed, cfg.shuffle_labels)
    if not rows:
        raise cli.UsageError(f"cache: no labelled ok volumes in {cache}")
    probe_dir = Path(probe_dir) if probe_dir else RunFolder(Path(tcfg.runs_dir) / tcfg.name).probe
    device = runtime.device_for(cfg.device)
    precision = features.resolve_precision(cfg.precision, device)
    views = {name: (enc, cfg.token_pool, features.feature_key(idn, rows, tcfg, cfg.token_pool, precision))
             for name, (enc, idn) in encoders.items()}
    views.update({f"{name} grid": (encoders[name][0], features.FULL_GRID,
                                   features.grid_key(encoders[name][1], rows, tcfg, precision)) for name in grids})
    feats, reused = features.cached_all(probe_dir / "features", {n: v[2] for n, v in views.items()},
                                        lambda names, part: features.extract_all(
        {n: views[n][0] for n in names}, tcfg, rows[part], cache, {n: views[n][1] for n in names}, device,
        cfg.extract_batch, precision=precision, pad=device.startswith("xla")), len(rows),
        write_only=[f"{name} grid" for name in grids])
    return {"rows": rows, "feats": {n: feats[n] for n in encoders}, "reused": {n: reused[n] for n in encoders},
            "cache": cache, "probe_dir": probe_dir, "precision": precision}


def probe_checkpoint(cfg: ProbeConfig, ckpt: str, probe_dir: Path | None = None, reports: bool = True) -> dict:
    """All tasks' probes for one checkpoint, from features extracted once (checkpoint_features):
    the unit `make probe` and `make leaderboard` share."""
    f = checkpoint_features(cfg, ckpt, probe_dir)
    rows, probe_dir = f["rows"], f["probe_dir"]
    results = {}
    for task in cfg.tasks:
        suffix = "_shuffled" if cfg.shuffle_labels else ""
        results[task] = probe_task(task, cfg, rows, f["feats"], probe_dir / f"{task}{suffix}" if reports else None)
    return {"ckpt": ckpt, "step": f["step"], "cache": f["cache"], "rows": len(rows),
            "rows_fingerprint": rows_fingerprint(rows), "features_reused": f["reused"], "results": results,
            "probe_dir": str(probe_dir)}


def run(cfg: ProbeConfig) -> dict:
    """The probes of `ckpt`, or of `run`'s newest checkpoint (a local or a gs:// run), reported in the
    run's local folder (a gs:// run's: runs/<name>, train/run_folder.py local_folder)."""
    ckpt = resolve_checkpoint(cfg)
    return probe_checkpoint(cfg, ckpt, RunFolder(run_folder.local_folder(cfg.run)).probe if cfg.run else None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make probe", description=__doc__)
    ap.add_argument("--config", default=None)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    cfg = config.load(ProbeConfig, a.config, a.overrides)
    if a.ckpt:
        cfg.ckpt = a.ckpt
    t0 = time.perf_counter()
    out = run(cfg)
    print(f"probe: {out['ckpt']} on {out['cache']} ({out['rows']} labelled volumes, on "
          f"{runtime.device_for(cfg.device)}); features reused: {out['features_reused']}")
    for task, res in out["results"].items():
        rows = [(p["encoder"], p["head"], cli.fmt_number(p["test"]["balanced_accuracy"], p["test"]["balanced_accuracy_ci95"]),
                 cli.fmt_number(p["test"]["auroc_macro_ovr"]), "YES" if p["test"]["collapsed"] else "no") for p in res["probes"]]
        print(f"\n{task} (test):")
        print(cli.format_table(["encoder", "head", "balanced acc [95% CI]", "AUROC", "collapsed"], rows))
    print(f"\nprobe: reports in {out['probe_dir']}/<task>/ (metrics.json, report.md, confusion.png, roc.png); "
          f"{time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    cli.run(main)

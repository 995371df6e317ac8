"""The learning check's probes (check/learning_check.py), on features extracted once per encoder.

Every head kind of the probe config is fit on a fold's train rows with its hyperparameters chosen
on the val rows; the fold's head kind is chosen on val by the one-standard-error rule (docs/recipe.md,
Probes), and heads are scored on the test rows. The headline reads both encoders through one kind
per fold, chosen on their mean val (pair_choice). A fold is the cohort's own split,
or, for the scanners cue, three scanners' train and val rows with the fourth scanner's test rows
held out, each scanner in turn (evals/subsets.py). A label fraction narrows every fold's train
rows to the same participants for every encoder. Encoders are compared on the same test rows
with a paired participant bootstrap, so what the test rows share cancels out.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from evals import probe, subsets
from evals import probe_metrics as pm
from evals.config import ProbeConfig
from manifests.aireadi import TASKS

CHOSEN = "chosen_on_val"  # per fold and encoder, the head kind chosen on its val (one_se_choice)
SAME_KIND = "same_kind_chosen_on_val"  # per fold, one head kind for pretrained and random init (pair_choice)
# the order the one-standard-error rule prefers: by parameters per head (d x classes; 4 d + 4 d x classes;
# 2 x 64 d + 64 + d x classes)
SIMPLEST_FIRST = ("linear", "attentive", "mil")


def folds(rows: list[dict], protocol: str) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """[(name, train, val, test masks)]: one fold (the splits) or one per held-out scanner that
    has test rows."""
    if protocol == "scanners":
        return [f for f in subsets.scanner_folds(rows) if f[3].any()]
    split = np.array([r["split"] for r in rows])
    return [("splits", split == "train", split == "val", split == "test")]


def narrowed(fs: list, rows: list[dict], participants: set[str]) -> list:
    """The folds with their train rows narrowed to these participants."""
    keep = subsets.train_mask(rows, participants)
    return [(name, tr & keep, va, te) for name, tr, va, te in fs]


def task_arrays(task: str, rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Class index, split and participant of each row, and the number of classes."""
    spec = TASKS[task]
    return (np.array([spec["map"](r["label"]) for r in rows]), np.array([r["split"] for r in rows]),
            np.array([r["participant_id"] for r in rows]), spec["classes"])


def fit_encoder(cfg: ProbeConfig, feats: dict, task: str, rows: list[dict], fs: list, full: list | None = None) -> dict:
    """{head kind, and CHOSEN: {"prob": test-row probabilities assembled over the folds (each
    test row from the fold that tests it), "val": mean over folds of the val balanced accuracy,
    "heads": the head of each fold; for CHOSEN also "val_best": each fold's head with the best val score}}.
    `full`: for folds narrowed to a label fraction, the folds they were narrowed from: each fold's
    heads then train at least the steps of its own full train split (probe.fraction_steps)."""
    return fit_encoders(cfg, [feats], task, rows, fs, full)[0]


def fit_encoders(cfg: ProbeConfig, feats: list[dict], task: str, rows: list[dict], fs: list,
                 full: list | None = None, pair: bool = False) -> list[dict]:
    """fit_encoder for each of several encoders' features of the same rows (the pretrained encoder
    and the random-init draws), each fold's heads of every encoder trained as one stack
    (probe.fit_and_select_all): each encoder's result is the one it gets alone, float rounding apart.
    `pair`: feats are the pretrained encoder's, then random init's draws; every result then also
    holds SAME_KIND, the kind pair_choice takes for them all per fold, with "pair_val": each fold's
    pair score per kind."""
    if pair and len(feats) < 2:
        raise ValueError("pair: the pretrained encoder's features and at least one random-init draw's")
    y, split, groups, k = task_arrays(task, rows)
    outs = [{kind: {"prob": np.zeros((len(y), k)), "val": [], "heads": []}
             for kind in [*cfg.heads, CHOSEN, *([SAME_KIND] if pair else [])]} for _ in feats]
    for out in outs:
        out[CHOSEN]["val_best"] = []
        if pair:
            out[SAME_KIND]["pair_val"] = []
    for i, (_, tr, va, te) in enumerate(fs):
        fcfg = cfg if full is None else dataclasses.replace(cfg, min_steps=probe.fraction_steps(cfg, full[i][1]))
        fitted = [{} for _ in feats]
        for kind in cfg.heads:
            for e, (chosen, prob) in enumerate(probe.fit_and_select_all(kind, fcfg, feats, y, split, k, tr, va)):
                fitted[e][kind] = (probe.val_rank(chosen["val_balanced_accuracy"], chosen["val_auroc"]), prob)
        same, pair_val = pair_choice(fitted) if pair else (None, None)
        for out, fit in zip(outs, fitted):
            out[CHOSEN]["val_best"].append(max(fit, key=lambda h: fit[h][0]))
            pick = one_se_choice(fit, y, groups, va, k, cfg.bootstrap, cfg.seed)
            for kind, head in [*((h, h) for h in fit), (CHOSEN, pick), *([(SAME_KIND, same)] if pair else [])]:
                rank, prob = fit[head]
                out[kind]["prob"][te] = prob[te]
                out[kind]["val"].append(rank[0])
                out[kind]["heads"].append(head)
            if pair:
                out[SAME_KIND]["pair_val"].append(pair_val)
    return [{kind: {**v, "val": float(np.mean(v["val"]))} for kind, v in out.items()} for out in outs]


def one_se_choice(fitted: dict, y: np.ndarray, groups: np.ndarray, va: np.ndarray, k: int, n_boot: int,
                  seed: int) -> str:
    """The head kind a fold uses: the simplest kind (SIMPLEST_FIRST) whose val balanced
    accuracy is within one standard error of the best kind's, the error being the participant
    bootstrap's spread of the paired val difference. On a val split of about 150 participants two
    near-equal heads are ranked by chance, and the best of a grid of noisier heads is the more
    optimistic (the one-standard-error rule: Hastie, Tibshirani and Friedman, ESL section 7.10).
    fitted: {kind: (val rank, probabilities of every row)}."""
    best = max(fitted, key=lambda h: fitted[h][0])
    for kind in sorted(fitted, key=SIMPLEST_FIRST.index):
        if kind == best:
            break
        d = pm.paired_difference_ci(y[va], fitted[best][1][va], fitted[kind][1][va], groups[va], k, n_boot, seed)
        if d["difference_se"] is not None and d["difference"] <= d["difference_se"]:
            return kind
    return best


def pair_choice(fitted: list[dict]) -> tuple[str, dict]:
    """The head kind a fold's headline reads every encoder through (docs/recipe.md, Probes),
    and the pair's val balanced accuracy of each kind: the kind with the best mean val score over the
    pretrained encoder (fitted[0]) and random init (the others, its draws, whose mean counts once, as
    its row reads their mean), a half each; ties by the mean val AUROC, then the simpler kind. One
    kind for both, so the paired difference compares encoders, not heads; the mean over both favours
    neither. fitted: per encoder, {kind: (val rank, probabilities of every row)}."""
    def rank(kind: str) -> tuple[float, float]:
        draws = np.mean([f[kind][0] for f in fitted[1:]], axis=0)
        return tuple(float(v) for v in (np.asarray(fitted[0][kind][0]) + draws) / 2)

    kinds = sorted(fitted[0], key=SIMPLEST_FIRST.index)
    return max(kinds, key=rank), {kind: rank(kind)[0] for kind in kinds}


def majority(task: str, rows: list[dict], fs: list) -> np.ndarray:
    """Each fold's most frequent train class, as probabilities on its test rows."""
    y, _, _, k = task_arrays(task, rows)
    prob = np.zeros((len(y), k))
    for _, tr, _, te in fs:
        prob[te, np.bincount(y[tr], minlength=k).argmax()] = 1.0
    return prob


def tested_rows(fs: list) -> np.ndarray:
    return np.logical_or.reduce([te for _, _, _, te in fs])


def score(task: str, rows: list[dict], prob: np.ndarray, mask: np.ndarray, n_boot: int, seed: int) -> dict:
    """Test balanced accuracy with its participant-bootstrap interval."""
    return mean_score(task, rows, [prob], mask, n_boot, seed)


def paired(task: str, rows: list[dict], a: np.ndarray, b: np.ndarray, mask: np.ndarray, n_boot: int, seed: int) -> dict:
    """a minus b in test balanced accuracy, with the paired interval over participants."""
    return mean_paired(task, rows, [a], [b], mask, n_boot, seed)


def mean_score(task: str, rows: list[dict], probs: list, mask: np.ndarray, n_boot: int, seed: int) -> dict:
    """Test balanced accuracy averaged over runs (training seeds), its interval from participant
    resamples on which every run is scored."""
    y, _, groups, k = task_arrays(task, rows)
    c = pm.contrast_ci(y[mask], [(1 / len(probs), p[mask]) for p in probs], groups[mask], k, n_boot, seed)
    return {"balanced_accuracy": c["difference"], "ci95": c["difference_ci95"]}


def mean_paired(task: str, rows: list[dict], a: list, b: list, mask: np.ndarray, n_boot: int, seed: int) -> dict:
    """The mean over a's runs minus the mean over b's in test balanced accuracy, paired over participants."""
    y, _, groups, k = task_arrays(task, rows)
    terms = [(1 / len(a), p[mask]) for p in a] + [(-1 / len(b), q[mask]) for q in b]
    return pm.contrast_ci(y[mask], terms, groups[mask], k, n_boot, seed)


def seed_resampled_paired(task: str, rows: list[dict], a: list, b: list, mask: np.ndarray, n_boot: int, seed: int) -> dict:
    """The mean over training seeds of a[i] - b[i] (runs paired by seed), with an interval from a two-stage
    bootstrap that draws the seeds with replacement as well as the participants. mean_paired's interval holds
    the seeds fixed, so it leaves out how far another draw of training seeds would move the mean
    (docs/history/learning-check.md: the fine-tuning mean's interval with the training seeds drawn too).
    Coarse with few seeds: at three, one seed drawn three times is 1 draw in 9 (each 1 in 27), so the
    bounds sit near the lowest and highest per-seed differences, blurred by the participants' spread; it is a reading of how far the seeds disagree, not a calibrated 95% interval, and not the verdict's."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"seed_resampled_paired: needs two or more runs per side, paired by seed (got {len(a)} and {len(b)})")
    y, _, groups, k = task_arrays(task, rows)
    y, groups = y[mask], groups[mask]
    pred = [(p[mask].argmax(1), q[mask].argmax(1)) for p, q in zip(a, b)]

    def per_seed(idx):
        return np.array([pm.balanced_accuracy(y[idx], pa[idx], k) - pm.balanced_accuracy(y[idx], pb[idx], k)
                         for pa, pb in pred])

    rng = np.random.default_rng([seed, len(a)])  # the seeds' draws, apart from the participants' (participant_resamples)
    vals = np.array([per_seed(idx)[rng.integers(len(a), size=len(a))].mean()
                     for idx in pm.participant_resamples(groups, n_boot, seed)], dtype=float)
    spread = per_seed(np.arange(len(y)))
    return {"difference": float(spread.mean()), "difference_ci95": pm.ci95(vals), "per_seed": spread.tolist(),
            "bootstrap_resamples": n_boot, "seeds": len(a)}


def draws(fit) -> list[dict]:
    """An encoder's fits as a list: a random-init row reads the mean of several draws (docs/recipe.md,
    Probes), any other encoder is one fit_encoder result."""
    return fit if isinstance(fit, list) else [fit]


def probs(fit, kind: str = CHOSEN) -> list[np.ndarray]:
    """Each draw's test-row probabilities for a head kind."""
    return [d[kind]["prob"] for d in draws(fit)]


def compare(task: str, rows: list[dict], fits: dict, fs: list, n_boot: int, seed: int) -> dict:
    """Pretrained against random-init for each head kind, for the heads each chose on val and, where
    the fits hold it, for the one kind chosen for the pair (SAME_KIND, with its `pair_val`): the
    learning check's table (fits: {encoder: fit_encoder(...), or a list of them for random init's
    draws, whose mean the row reads; each draw's own row is kept under `random_draws`})."""
    te = tested_rows(fs)
    _, _, groups, k = task_arrays(task, rows)
    out = {"task": task, "classes": k, "test_rows": int(te.sum()), "test_participants": int(len(set(groups[te]))),
           "majority_class": score(task, rows, majority(task, rows, fs), te, n_boot, seed)["balanced_accuracy"],
           "comparisons": {}}
    p, r = draws(fits["pretrained"]), draws(fits["random_init"])
    for kind in p[0]:
        pp, rp = probs(p, kind), probs(r, kind)
        sp, sr = (mean_score(task, rows, x, te, n_boot, seed) for x in (pp, rp))
        out["comparisons"][kind] = {
            "pretrained_head": _heads(_kind(p, kind)), "random_head": _heads(_kind(r, kind)),
            "pretrained": sp["balanced_accuracy"], "pretrained_ci95": sp["ci95"],
            "random_init": sr["balanced_accuracy"], "random_init_ci95": sr["ci95"],
            "val": {"pretrained": _mean_val(p, kind), "random_init": _mean_val(r, kind)},
            **({"val_best": {"pretrained": _heads(_kind(p, kind), "val_best"),
                             "random_init": _heads(_kind(r, kind), "val_best")}}
               if kind == CHOSEN else {}),  # the heads the best val score alone would have used
            **({"pair_val": p[0][kind]["pair_val"]} if kind == SAME_KIND else {}),
            **mean_paired(task, rows, pp, rp, te, n_boot, seed),
            **({"random_draws": draw_rows(task, rows, pp, r, te, n_boot, seed, kind)}
               if len(r) > 1 and kind in (CHOSEN, SAME_KIND) else {})}
    return out


def draw_rows(task: str, rows: list[dict], pretrained: list, rand: list, mask: np.ndarray, n_boot: int,
              seed: int, kind: str = CHOSEN) -> list[dict]:
    """Each random-init draw's own row through `kind`'s heads."""
    return [{"draw": i, "random_init": score(task, rows, d[kind]["prob"], mask, n_boot, seed)["balanced_accuracy"],
             "head": _heads(d[kind]), **mean_paired(task, rows, pretrained, [d[kind]["prob"]], mask, n_boot, seed)}
            for i, d in enumerate(rand, 1)]


def _kind(fits: list[dict], kind: str) -> list[dict]:
    return [f[kind] for f in fits]


def _mean_val(fits: list[dict], kind: str) -> float:
    return float(np.mean([f[kind]["val"] for f in fits]))


def per_scanner(task: str, rows: list[dict], fits: dict, fs: list, n_boot: int, seed: int) -> dict:
    """Each held-out scanner's test rows: both encoders (heads chosen on val; random init the mean of
    its draws) and the paired difference."""
    p, r = probs(fits["pretrained"]), probs(fits["random_init"])
    out = {}
    for name, _, _, te in fs:
        out[name] = {"pretrained": mean_score(task, rows, p, te, n_boot, seed)["balanced_accuracy"],
                     "random_init": mean_score(task, rows, r, te, n_boot, seed)["balanced_accuracy"],
                     **mean_paired(task, rows, p, r, te, n_boot, seed)}
    return out


def curve_point(task: str, rows: list[dict], fits: dict, fs: list, n_boot: int, seed: int) -> dict:
    """One label fraction: each encoder's test score (heads chosen on val; random init the mean of
    its draws) and pretrained minus each other encoder, paired."""
    te = tested_rows(fs)
    chosen = {name: probs(f) for name, f in fits.items()}
    out = {name: {**mean_score(task, rows, chosen[name], te, n_boot, seed), "heads": _heads(_kind(draws(f), CHOSEN))}
           for name, f in fits.items()}
    for other in chosen:
        if other != "pretrained":
            out[f"pretrained_minus_{other}"] = mean_paired(task, rows, chosen["pretrained"], chosen[other], te, n_boot,
                                                           seed)
    return out


def _heads(entry, key: str = "heads") -> str:
    """The head kinds one head kind's entry of a fit (or of each draw's fit, a list) used, joined."""
    return "/".join(sorted({h for e in (entry if isinstance(entry, list) else [entry]) for h in e[key]}))

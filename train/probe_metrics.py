"""Classification metrics for probes, with participant-level bootstrap intervals.

Written with numpy so they run anywhere; tests check them against scikit-learn.
"""
from __future__ import annotations

import numpy as np

COLLAPSE_FRACTION = 0.8  # one class taking this share of predictions flags a collapsed probe


def confusion(y: np.ndarray, pred: np.ndarray, k: int) -> np.ndarray:
    m = np.zeros((k, k), dtype=np.int64)
    np.add.at(m, (y, pred), 1)
    return m


def per_class_accuracy(y, pred, k) -> list[float | None]:
    m = confusion(y, pred, k)
    support = m.sum(1)
    return [float(m[c, c] / support[c]) if support[c] else None for c in range(k)]


def balanced_accuracy(y, pred, k) -> float:
    acc = [a for a in per_class_accuracy(y, pred, k) if a is not None]
    return float(np.mean(acc)) if acc else float("nan")


def binary_auroc(y01: np.ndarray, score: np.ndarray) -> float:
    """Mann-Whitney AUROC with average ranks for ties (what roc_auc_score computes)."""
    pos, neg = y01 == 1, y01 == 0
    if pos.sum() == 0 or neg.sum() == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score), dtype=np.float64)
    sorted_scores = score[order]
    i = 0
    while i < len(score):  # average ranks over ties
        j = i
        while j + 1 < len(score) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * neg.sum()))


def macro_auroc(y, prob: np.ndarray) -> float:
    """Macro one-vs-rest AUROC over the classes present in y (binary: AUROC of class 1)."""
    k = prob.shape[1]
    if k == 2:
        return binary_auroc((y == 1).astype(int), prob[:, 1])
    vals = [binary_auroc((y == c).astype(int), prob[:, c]) for c in range(k) if 0 < (y == c).sum() < len(y)]
    return float(np.mean(vals)) if vals else float("nan")


def prediction_entropy(prob: np.ndarray) -> float:
    """Mean entropy (nats) of the predicted distributions: near 0 = confident, log k = uniform."""
    p = np.clip(prob, 1e-12, 1)
    return float(-(p * np.log(p)).sum(1).mean())


def collapsed(pred, k: int) -> bool:
    return bool(np.bincount(pred, minlength=k).max() >= COLLAPSE_FRACTION * len(pred)) if len(pred) else False


def summary(y, prob, k: int) -> dict:
    pred = prob.argmax(1)
    return {
        "n": int(len(y)), "balanced_accuracy": balanced_accuracy(y, pred, k), "auroc_macro_ovr": macro_auroc(y, prob),
        "per_class_accuracy": per_class_accuracy(y, pred, k), "confusion": confusion(y, pred, k).tolist(),
        "prediction_entropy": prediction_entropy(prob), "collapsed": collapsed(pred, k),
        "predicted_class_fraction": (np.bincount(pred, minlength=k) / max(1, len(pred))).tolist(),
    }


def participant_resamples(groups, n_boot: int, seed: int):
    """Row indices of `n_boot` bootstrap resamples that draw participants (clusters) with
    replacement and keep all rows of each: a participant's eyes are not independent."""
    rng = np.random.default_rng(seed)
    ids = np.unique(groups)
    rows_of = {g: np.flatnonzero(groups == g) for g in ids}
    for _ in range(n_boot):
        pick = rng.choice(ids, size=len(ids), replace=True)
        yield np.concatenate([rows_of[g] for g in pick])


def _ci95(v) -> list:
    v = np.asarray(v, dtype=float)
    v = v[np.isfinite(v)]
    return [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] if len(v) else [None, None]


def bootstrap_ci(y, prob, groups, k: int, n_boot: int = 1000, seed: int = 0) -> dict:
    """95% intervals of balanced accuracy and AUROC, resampling participants (clusters)."""
    ba, au = [], []
    for idx in participant_resamples(groups, n_boot, seed):
        ba.append(balanced_accuracy(y[idx], prob[idx].argmax(1), k))
        au.append(macro_auroc(y[idx], prob[idx]))
    return {"balanced_accuracy_ci95": _ci95(ba), "auroc_macro_ovr_ci95": _ci95(au), "bootstrap_resamples": n_boot}


def paired_difference_ci(y, prob_a, prob_b, groups, k: int, n_boot: int = 1000, seed: int = 0) -> dict:
    """Balanced accuracy of a minus b with a paired 95% interval: each resample of participants
    scores both predictors on the same rows, so what they share cancels out."""
    diffs = [balanced_accuracy(y[idx], prob_a[idx].argmax(1), k) - balanced_accuracy(y[idx], prob_b[idx].argmax(1), k)
             for idx in participant_resamples(groups, n_boot, seed)]
    point = balanced_accuracy(y, prob_a.argmax(1), k) - balanced_accuracy(y, prob_b.argmax(1), k)
    return {"difference": float(point), "difference_ci95": _ci95(diffs), "bootstrap_resamples": n_boot,
            "participants": int(len(np.unique(groups)))}

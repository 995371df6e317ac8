"""Probe summaries with participant-level bootstrap intervals, on the floor's scores (octfm/scores.py)."""
from __future__ import annotations

import numpy as np

from octfm.scores import (COLLAPSE_FRACTION, balanced_accuracy, binary_auroc, collapsed, confusion,  # noqa: F401
                          macro_auroc, per_class_accuracy, prediction_entropy)

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


def ci95(v) -> list:
    v = np.asarray(v, dtype=float)
    v = v[np.isfinite(v)]
    return [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] if len(v) else [None, None]


def bootstrap_ci(y, prob, groups, k: int, n_boot: int = 1000, seed: int = 0) -> dict:
    """95% intervals of balanced accuracy and AUROC, resampling participants (clusters)."""
    ba, au = [], []
    for idx in participant_resamples(groups, n_boot, seed):
        ba.append(balanced_accuracy(y[idx], prob[idx].argmax(1), k))
        au.append(macro_auroc(y[idx], prob[idx]))
    return {"balanced_accuracy_ci95": ci95(ba), "auroc_macro_ovr_ci95": ci95(au), "bootstrap_resamples": n_boot}


def paired_difference_ci(y, prob_a, prob_b, groups, k: int, n_boot: int = 1000, seed: int = 0) -> dict:
    """Balanced accuracy of a minus b with a paired 95% interval and standard error: each
    resample of participants scores both predictors on the same rows, so what they share cancels out."""
    return contrast_ci(y, [(1.0, prob_a), (-1.0, prob_b)], groups, k, n_boot, seed)


def contrast_ci(y, terms, groups, k: int, n_boot: int = 1000, seed: int = 0) -> dict:
    """sum(weight x balanced accuracy of prob) over `terms` [(weight, prob)], all scored on each
    participant resample: a paired difference (1, -1), a mean over seeds of differences (1/n, -1/n
    each) or a difference of differences, with its 95% interval and standard error."""
    def value(idx):
        return sum(w * balanced_accuracy(y[idx], p[idx].argmax(1), k) for w, p in terms)

    vals = np.array([value(idx) for idx in participant_resamples(groups, n_boot, seed)], dtype=float)
    vals = vals[np.isfinite(vals)]
    point = value(np.arange(len(y)))
    return {"difference": float(point), "difference_ci95": ci95(vals),
            "difference_se": float(np.std(vals)) if len(vals) > 1 else None, "bootstrap_resamples": n_boot,
            "participants": int(len(np.unique(groups)))}

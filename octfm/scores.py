"""Plain classification scores (numpy only, checked against scikit-learn in the tests).

They live on the floor so the trainer's online probe and the offline probes (evals/) score
with one implementation; the bootstrap and the probe logic stay in evals/.
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

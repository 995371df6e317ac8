"""The token-level lesion probe (check/token_probe.py): lesions land on the tokens that hold them,
and the within-position AUROC is the pooled pair count it claims to be, bootstrap weights included."""
import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from check import token_probe as tp


def _lesion(y, x, z, ry=0.02, rx=0.01, rz=0.005):
    return {"y": y, "x": x, "z": z, "radius_y": ry, "radius_x": rx, "radius_z": rz}


def test_a_lesion_marks_the_token_of_its_centre_and_leaves_out_its_edge():
    cache, crop, tubelet = (32, 128, 128), (32, 96, 96), (4, 16, 16)   # grid 8 x 6 x 6, crop offset (0, 16, 16)
    # frame 13.6 -> token 3; row 0.5625 * 128 = 72 -> crop 56 -> token 3; column (0.1 + 1) / 2 * 128 = 70.4 -> 54.4 -> token 3
    small = tp.token_labels(pd.DataFrame([_lesion(13.6 / 16 - 1, 0.1, 0.5625)]), cache, crop, tubelet).reshape(8, 6, 6)
    assert small[3, 3, 3] == tp.LESION and (small == tp.LESION).sum() == 1
    assert (small == tp.LEFT_OUT).sum() == 0               # small radii: no neighbour within two radii
    # a wide lesion on the same centre reaches the neighbouring columns' tokens: left out, not background
    wide = tp.token_labels(pd.DataFrame([_lesion(13.6 / 16 - 1, 0.1, 0.5625, rx=0.2)]), cache, crop, tubelet)
    wide = wide.reshape(8, 6, 6)
    assert wide[3, 3, 3] == tp.LESION and wide[3, 3, 2] == tp.LEFT_OUT and wide[3, 3, 4] == tp.LEFT_OUT
    assert wide[0, 0, 0] == tp.BACKGROUND
    # a centre outside the crop (column 5 of 128) marks no lesion token
    outside = tp.token_labels(pd.DataFrame([_lesion(0.0, 5 / 64 - 1, 0.5)]), cache, crop, tubelet)
    assert (outside == tp.LESION).sum() == 0
    assert (tp.token_labels(None, cache, crop, tubelet) == tp.BACKGROUND).all()


def test_within_position_auroc_pools_the_pairs_at_each_position():
    rng = np.random.default_rng(0)
    n = 600
    position = rng.integers(0, 5, n)
    label = np.where(rng.random(n) < 0.1, tp.LEFT_OUT,
                     np.where(rng.random(n) < 0.05 + 0.1 * position, tp.LESION, tp.BACKGROUND))
    score = rng.normal(size=n) + 0.8 * (label == tp.LESION)
    pairs = hits = 0.0
    for p in range(5):
        m = (position == p) & (label >= 0)
        y = label[m] == tp.LESION
        pairs += y.sum() * (~y).sum()
        hits += roc_auc_score(y, score[m]) * y.sum() * (~y).sum()
    got = tp.within_position_auroc(score, label, position)[0]
    assert got == pytest.approx(hits / pairs)
    # lesions are commoner at later positions: the position alone ranks them overall, not within a position
    where = position + 0.01 * rng.normal(size=n)
    assert roc_auc_score(label[label >= 0] == tp.LESION, where[label >= 0]) > 0.65
    assert tp.within_position_auroc(where, label, position)[0] == pytest.approx(0.5, abs=0.08)
    # integer weights equal repeating rows
    w = rng.integers(0, 3, n)
    rep = np.repeat(np.arange(n), w)
    assert tp.within_position_auroc(score, label, position, w[None].astype(float))[0] == pytest.approx(
        tp.within_position_auroc(score[rep], label[rep], position[rep])[0])


def test_the_probe_finds_a_feature_that_carries_the_lesion_and_not_one_that_does_not():
    rng = np.random.default_rng(1)
    n, tokens = 60, 20
    labels = np.where(rng.random((n, tokens)) < 0.1, tp.LESION, tp.BACKGROUND).astype(np.int8)
    split = np.array(["train"] * 30 + ["val"] * 15 + ["test"] * 15)
    people = np.array([f"p{i // 2}" for i in range(n)])
    carries = rng.normal(size=(n, tokens, 4)).astype(np.float32)
    carries[..., 0] += 2.0 * (labels == tp.LESION)
    blind = rng.normal(size=(n, tokens, 4)).astype(np.float32)
    scores = {"pretrained": tp.score_encoder(carries, labels, split), "random_init": tp.score_encoder(blind, labels, split)}
    res = tp.compare_scorers(scores, labels, split, people, 100, 0)
    assert res["scorers"]["pretrained"]["test_auroc"] > 0.85
    assert 0.35 < res["scorers"]["random_init"]["test_auroc"] < 0.65
    assert res["pretrained_minus_random_init"]["difference_ci95"][0] > 0.2

"""The online probe: its classifiers, its features (the offline extractor's), and its records
in metrics.jsonl and the progress line of a real run."""
import json

import numpy as np
import pytest
from conftest import run_here, tiny_train_args, train_here

from octfm import config
from evals import features
from train import online_probe
from train.config import TrainConfig
from train.model import Encoder


def planted(n: int, classes: int, signal: float, seed: int, weights=None):
    """Features [n, 32] whose first 4 dimensions carry the class (scaled by `signal`)."""
    rng = np.random.default_rng(seed)
    y = rng.choice(classes, size=n, p=weights)
    x = rng.normal(size=(n, 32))
    x[:, :4] += signal * np.eye(classes, 4)[y] * 3
    return x, y


@pytest.mark.parametrize("predict", ["knn", "ridge"])
def test_classifiers_find_a_planted_class_and_stay_at_chance_without_one(predict):
    from octfm.scores import balanced_accuracy

    def score(signal, weights=None):
        xtr, ytr = planted(200, 4, signal, 0, weights)
        xva, yva = planted(200, 4, signal, 1)
        pred = (online_probe.knn_predict(xtr, ytr, xva, 10, 4) if predict == "knn"
                else online_probe.ridge_predict(xtr, ytr, xva, 1.0, 4))
        return balanced_accuracy(yva, pred, 4)

    # k-NN standardises every channel, which shrinks these cue channels (the class shift is most
    # of their spread) toward the 28 noise ones: 0.81 / 0.78 here, where centring alone gave 0.9+;
    # the price of reading a cue that sits in small channels (the test below: 0.47 -> 0.9+)
    good, skewed = (0.75, 0.7) if predict == "knn" else (0.9, 0.85)
    assert score(1.0) > good
    assert score(1.0, weights=[0.7, 0.1, 0.1, 0.1]) > skewed  # the majority class does not win by numbers
    assert 0.1 < score(0.0) < 0.4                             # chance is 0.25


def test_knn_reads_a_class_in_small_channels_beside_large_noisy_ones():
    """Max-pooled features have a few channels of large spread that are not the cue (the learning
    check's k-NN stayed at 0.43-0.51 while ridge and the offline probes rose): k-NN on features
    standardised per channel, as ridge and the offline probes standardise, still reads the class."""
    from octfm.scores import balanced_accuracy

    def data(seed):
        x, y = planted(300, 2, 1.0, seed)
        x[:, :4] *= 0.05                        # the cue: small channels
        x[:, 4:8] *= 50.0                       # noise: large channels
        return x, y

    (xtr, ytr), (xva, yva) = data(0), data(1)
    assert balanced_accuracy(yva, online_probe.knn_predict(xtr, ytr, xva, 10, 2), 2) > 0.9


def test_online_features_are_the_offline_extractors(tiny_cache, tmp_path):
    """One pooling: the online probe's features of an encoder equal `make probe`'s pooled features."""
    import torch

    cfg = config.load(TrainConfig, "configs/pretrain_smoke.yaml", tiny_train_args(tiny_cache, tmp_path))
    torch.manual_seed(0)
    enc = Encoder(cfg.model, cfg.data.input_shape).eval()
    probe = online_probe.OnlineProbe(cfg, torch.device("cpu"))
    online = probe.features(enc, "val")
    offline = features.extract(enc, cfg, probe.rows["val"], str(tiny_cache), (1, 2, 2), batch=3)["pooled"]
    assert online.shape == offline.shape == (len(probe.rows["val"]), cfg.model.dim)
    np.testing.assert_allclose(online, offline, rtol=1e-4, atol=1e-5)


def test_run_logs_the_probe_at_step_0_and_every_eval_every_and_shows_it(tiny_cache, tmp_path):
    args = tiny_train_args(tiny_cache, tmp_path, name="p", max_steps=4, eval_every=2,
                           **{"online_probe.max_train": 6, "online_probe.k": 3})
    r = run_here("train.pretrain", "--config", "configs/pretrain_smoke.yaml", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ridge_diabetic=" in r.stderr and "ridge_study_group=" in r.stderr  # the progress line
    probe = [json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    probe = {x["step"]: x for x in probe if x["split"] == "probe"}
    assert sorted(probe) == [0, 2, 4]
    for rec in probe.values():
        assert rec["train_rows"] == 6 and rec["val_rows"] > 0
        for task in ("study_group", "diabetic"):
            assert 0.0 <= rec[f"{task}/knn_bal_acc"] <= 1.0 and 0.0 <= rec[f"{task}/ridge_bal_acc"] <= 1.0
    # resumed: no second step-0 floor, the probe continues at the next multiple
    train_here(*tiny_train_args(tiny_cache, tmp_path, name="p", max_steps=6, eval_every=2,
                                **{"online_probe.max_train": 6, "online_probe.k": 3}))
    steps = [json.loads(x)["step"] for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "probe"]
    assert steps == [0, 2, 4, 6]

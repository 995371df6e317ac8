import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score, confusion_matrix, roc_auc_score

from evals import probe
from evals import probe_metrics as pm
from octfm import config
from octfm.cli import UsageError


def test_metrics_agree_with_scikit_learn():
    rng = np.random.default_rng(0)
    for k in (2, 4):
        y = rng.integers(0, k, 300)
        logits = rng.normal(size=(300, k)) + 1.5 * np.eye(k)[y]
        prob = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        pred = prob.argmax(1)
        assert pm.balanced_accuracy(y, pred, k) == pytest.approx(balanced_accuracy_score(y, pred))
        assert (pm.confusion(y, pred, k) == confusion_matrix(y, pred, labels=range(k))).all()
        ref = roc_auc_score(y, prob[:, 1]) if k == 2 else roc_auc_score(y, prob, multi_class="ovr", average="macro")
        assert pm.macro_auroc(y, prob) == pytest.approx(ref)
    ties = np.array([0.5, 0.5, 0.2, 0.8, 0.5])
    assert pm.binary_auroc(np.array([1, 0, 0, 1, 1]), ties) == pytest.approx(roc_auc_score([1, 0, 0, 1, 1], ties))


def test_collapse_flag_fires_on_a_constant_predictor():
    y = np.array([0, 1, 2, 3] * 10)
    const = np.tile(np.array([[0.1, 0.7, 0.1, 0.1]]), (40, 1))
    s = pm.summary(y, const, 4)
    assert s["collapsed"] and s["balanced_accuracy"] == pytest.approx(0.25)
    assert not pm.summary(y, np.eye(4)[y], 4)["collapsed"]


def _clustered_predictions(seed: int = 0):
    """20 participants with 10 rows each; a predictor that is right on every row of half the
    participants and wrong on every row of the others: errors come in whole participants."""
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(20), 10)
    y = rng.integers(0, 2, len(groups))
    right = np.repeat(np.arange(20) % 2 == 0, 10)
    pred = np.where(right, y, 1 - y)
    return y, np.eye(2)[pred] * 0.8 + 0.1, groups


def test_bootstrap_resamples_participants():
    """Resampling participants gives a much wider interval than resampling rows would: the
    rows of a participant are not independent (a row-level bootstrap fails this test)."""
    y, prob, groups = _clustered_predictions()
    by_person = pm.bootstrap_ci(y, prob, groups, 2, n_boot=400)["balanced_accuracy_ci95"]
    by_row = pm.bootstrap_ci(y, prob, np.arange(len(y)), 2, n_boot=400)["balanced_accuracy_ci95"]
    assert by_person[0] < 0.5 < by_person[1]
    assert by_person[1] - by_person[0] > 2 * (by_row[1] - by_row[0])
    assert by_person[1] - by_person[0] > 0.3


def test_paired_difference_resamples_participants_together():
    """Two predictors that share the participant-level errors and differ on 20% of rows: the
    paired interval over participants is narrow around +0.2 (unpaired intervals of each would
    overlap), and the same data resampled by row would be narrower still."""
    y, prob_b, groups = _clustered_predictions()
    pred_a = prob_b.argmax(1).copy()
    flip = np.flatnonzero(pred_a != y)[::2][:40]                   # a fixes 40 of b's 100 errors
    pred_a[flip] = y[flip]
    prob_a = np.eye(2)[pred_a] * 0.8 + 0.1
    d = pm.paired_difference_ci(y, prob_a, prob_b, groups, 2, n_boot=400)
    assert d["participants"] == 20
    assert d["difference"] == pytest.approx(pm.balanced_accuracy(y, pred_a, 2) - pm.balanced_accuracy(y, prob_b.argmax(1), 2))
    lo, hi = d["difference_ci95"]
    assert 0 < lo < d["difference"] < hi
    a_ci = pm.bootstrap_ci(y, prob_a, groups, 2, n_boot=400)["balanced_accuracy_ci95"]
    b_ci = pm.bootstrap_ci(y, prob_b, groups, 2, n_boot=400)["balanced_accuracy_ci95"]
    assert a_ci[0] < b_ci[1]                                        # unpaired: the intervals overlap
    by_row = pm.paired_difference_ci(y, prob_a, prob_b, np.arange(len(y)), 2, n_boot=400)["difference_ci95"]
    assert hi - lo > by_row[1] - by_row[0]


@pytest.fixture(scope="module")
def probe_run(signal_run, tmp_path_factory):
    """This module's copy of the session's 2-step run on the planted-signal cache (the probes write their
    reports and features into the run): the folder holding runs/p."""
    root = tmp_path_factory.mktemp("probe")
    shutil.copytree(signal_run, root / "runs" / "p")
    return root


def _cfg(root, **kw):
    base = {"run": str(root / "runs" / "p"), "epochs": 40, "bootstrap": 200}
    return config.from_dict(probe.ProbeConfig, {**base, **kw})


def _score(res, encoder, head):
    return next(p["test"]["balanced_accuracy"] for p in res["probes"] if p["encoder"] == encoder and p["head"] == head)


def test_planted_signal_is_found_and_features_are_reused(probe_run):
    out = probe.run(_cfg(probe_run))
    assert out["features_reused"] == {"pretrained": False, "random_init": False}
    sg, dia = out["results"]["study_group"], out["results"]["diabetic"]
    assert _score(sg, "pretrained", "linear") > 0.5 and _score(sg, "pretrained", "attentive") > 0.5  # chance 0.25
    assert _score(dia, "pretrained", "linear") > 0.75                                               # chance 0.5
    assert _score(sg, "none", "majority_class") == pytest.approx(0.25)
    ba = next(p for p in sg["probes"] if p["head"] == "linear")["test"]["balanced_accuracy_ci95"]
    assert ba[0] > 0.25
    task_dir = probe_run / "runs" / "p" / "probe" / "study_group"
    for name in ("metrics.json", "report.md", "confusion.png", "roc.png"):
        assert (task_dir / name).stat().st_size > 0
    metrics = json.loads((task_dir / "metrics.json").read_text())
    pre = [p for p in metrics["probes"] if p["encoder"] == "pretrained"]   # the plots show the head chosen on val
    assert metrics["plotted_head"] == max(pre, key=lambda p: probe.val_rank(p["val_balanced_accuracy"],
                                                                            p["val_auroc"]))["head"]
    test_devices = set(metrics["per_scanner"]["linear"])
    assert len(test_devices) >= 2 and test_devices <= {"heidelberg_spectralis", "topcon_maestro2", "topcon_triton",
                                                       "zeiss_cirrus"}
    assert metrics["cross_scanner"] and all(set(row) == test_devices for row in metrics["cross_scanner"].values())
    feats = sorted((probe_run / "runs" / "p" / "probe" / "features").glob("*.npz"))
    mtimes = [f.stat().st_mtime_ns for f in feats]
    again = probe.run(_cfg(probe_run, cross_scanner=False))
    assert again["features_reused"] == {"pretrained": True, "random_init": True}
    assert [f.stat().st_mtime_ns for f in feats] == mtimes


def test_random_init_draws_are_encoders_of_their_own_init_seeds(probe_run):
    """`baseline_draws` (docs/recipe.md, Probes): random-init encoders drawn with init seeds seed + 1, + 2,
    each extracted and probed under its own name, the first keeping the name it had alone."""
    cfg = _cfg(probe_run, cross_scanner=False, per_scanner=False, baseline_draws=2, tasks=["diabetic"], epochs=5)
    out = probe.run(cfg)
    assert set(out["features_reused"]) == {"pretrained", "random_init", "random_init_2"}
    assert {p["encoder"] for p in out["results"]["diabetic"]["probes"]} == {"pretrained", "random_init",
                                                                           "random_init_2", "none"}
    f = probe.checkpoint_features(cfg, out["ckpt"], probe_run / "runs" / "p" / "probe")
    assert all(f["reused"].values()) and probe.random_draws(f["feats"]) == ["random_init", "random_init_2"]
    assert not np.allclose(f["feats"]["random_init"]["pooled"], f["feats"]["random_init_2"]["pooled"])
    with pytest.raises(config.ConfigError, match="baseline_draws"):
        _cfg(probe_run, baseline_draws=0)


def test_encoders_read_in_one_pass_get_the_features_each_gets_alone(tiny_cache, tmp_path, monkeypatch):
    """features.extract_all: several encoders over one read of the cache give each the features
    `extract` gives it alone, and cached_all computes only the keys not on disk, together."""
    from conftest import tiny_train_args
    from evals import features
    from train import data
    from train.config import TrainConfig

    cfg = config.load(TrainConfig, "configs/pretrain_smoke.yaml", tiny_train_args(tiny_cache, tmp_path))
    rows = data.select_rows(str(tiny_cache), ["train", "val", "test"], None)[:5]
    encs = {f"draw{s}": features.checkpoint_encoder(None, seed=s, train_cfg=cfg)[0] for s in (1, 2)}
    together = features.extract_all(encs, cfg, rows, str(tiny_cache), (1, 2, 2), batch=2)
    for name, enc in encs.items():
        alone = features.extract(enc, cfg, rows, str(tiny_cache), (1, 2, 2), batch=2)
        assert all(np.array_equal(together[name][k], alone[k]) for k in ("pooled", "tokens"))
    assert not np.array_equal(together["draw1"]["pooled"], together["draw2"]["pooled"])
    # one encoder under two names, pooled two ways (the check's headline features and the token
    # probe's full grid): one forward a batch, each name's features as `extract` gives them alone
    calls = []
    hook = encs["draw1"].register_forward_hook(lambda *_: calls.append(1))
    views = features.extract_all({"draw1": encs["draw1"], "draw1 grid": encs["draw1"]}, cfg, rows, str(tiny_cache),
                                 {"draw1": (1, 2, 2), "draw1 grid": features.FULL_GRID}, batch=2)
    hook.remove()
    assert len(calls) == 3                                                                # 5 rows, batches of 2
    full = features.extract(encs["draw1"], cfg, rows, str(tiny_cache), features.FULL_GRID, batch=2)
    assert all(np.array_equal(views["draw1"][k], together["draw1"][k]) for k in ("pooled", "tokens"))
    assert np.array_equal(views["draw1 grid"]["tokens"], full["tokens"])
    assert views["draw1 grid"]["tokens"].shape[1] > views["draw1"]["tokens"].shape[1]
    asked = []

    def compute(names, part):
        asked.append((list(names), part.start, part.stop))
        return {n: {k: v[part] for k, v in together[n].items()} for n in names}

    keys = {"draw1": "k1", "draw2": "k2"}
    features.cached_all(tmp_path / "f", {"draw1": "k1"}, compute, len(rows))              # one kept already
    asked.clear()
    got, reused = features.cached_all(tmp_path / "f", keys, compute, len(rows))
    assert asked == [(["draw2"], 0, 5)] and reused == {"draw1": True, "draw2": False}
    assert np.array_equal(got["draw1"]["pooled"], together["draw1"]["pooled"])
    again, reused = features.cached_all(tmp_path / "f", keys, compute, len(rows))
    assert len(asked) == 1 and reused == {"draw1": True, "draw2": True}
    assert np.array_equal(again["draw2"]["tokens"], together["draw2"]["tokens"])
    # write-only names (the token probe's grids): made on disk in the same pass, never loaded nor returned
    loaded, real_load = [], features._load
    monkeypatch.setattr(features, "_load", lambda path: loaded.append(path.name) or real_load(path))
    got, reused = features.cached_all(tmp_path / "g", keys, compute, len(rows), write_only=["draw2"])
    assert set(got) == {"draw1"} and reused == {"draw1": False, "draw2": False} and asked[-1][0] == ["draw1", "draw2"]
    assert np.array_equal(real_load(tmp_path / "g" / "k2.npz")["tokens"], together["draw2"]["tokens"])
    loaded.clear()
    got, reused = features.cached_all(tmp_path / "g", keys, compute, len(rows), write_only=["draw2"])
    assert set(got) == {"draw1"} and reused == {"draw1": True, "draw2": True} and loaded == ["k1.npz"]


def test_features_killed_mid_pass_resume_from_the_rows_done(tmp_path, monkeypatch):
    """cached_all writes each part of the rows as it is computed: a pass killed after some parts
    computes only the rest when run again, and the arrays are those of one uninterrupted pass."""
    from evals import features

    monkeypatch.setattr(features, "PART_ROWS", 4)
    rng = np.random.default_rng(0)
    full = {n: {"pooled": rng.standard_normal((10, 3)).astype(np.float32),
                "tokens": rng.standard_normal((10, 2, 3)).astype(np.float16)} for n in ("a", "b")}
    asked = []

    def compute(names, part):
        asked.append(part.start)
        if len(asked) == 3:
            raise KeyboardInterrupt  # killed during the third part
        return {n: {k: v[part] for k, v in full[n].items()} for n in names}

    keys = {"a": "ka", "b": "kb"}
    with pytest.raises(KeyboardInterrupt):
        features.cached_all(tmp_path / "f", keys, compute, 10)
    assert not (tmp_path / "f" / "ka.npz").exists()
    got, reused = features.cached_all(tmp_path / "f", keys, compute, 10, write_only=["b"])  # b: from its parts on disk
    assert asked == [0, 4, 8, 8] and reused == {"a": False, "b": False} and set(got) == {"a"}
    got["b"] = features._load(tmp_path / "f" / "kb.npz")
    for n in keys:
        assert all(np.array_equal(got[n][k], full[n][k]) and got[n][k].dtype == full[n][k].dtype for k in full[n])
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["ka.npz", "kb.npz"]   # the parts are gone


def test_shuffled_labels_stay_at_chance(probe_run):
    out = probe.run(_cfg(probe_run, shuffle_labels=True, cross_scanner=False, baselines=False))
    assert _score(out["results"]["study_group"], "pretrained", "linear") < 0.45
    assert _score(out["results"]["diabetic"], "pretrained", "linear") < 0.7


def test_participant_leak_is_refused(signal_cache, tmp_path):
    df = pd.read_parquet(signal_cache / "manifest.parquet")
    pid = df.participant_id.iloc[0]
    other = {"train": "test", "val": "train", "test": "train"}[df.split.iloc[0]]
    df.loc[df.index[1:][df.participant_id.iloc[1:] == pid][:1], "split"] = other
    if (df[df.participant_id == pid].split.nunique()) < 2:  # the participant has a single row: add one
        extra = df[df.participant_id == pid].iloc[:1].assign(split=other, relpath="x")
        df = pd.concat([df, extra])
    (tmp_path / "manifest.parquet").mkdir()
    df.to_parquet(tmp_path / "manifest.parquet" / "part-0000-of-0001.parquet")
    with pytest.raises(UsageError, match="more than one split"):
        probe.labelled_rows(str(tmp_path), 0, False)


@pytest.mark.parametrize("kind", ["mil"])
def test_token_heads_find_two_marked_tokens_among_72_and_not_a_shuffled_label(kind):
    """A bag is positive when 2 of its 72 tokens carry a mark (a shift along one direction, buried
    in noise), as a few lesion tokens sit among the grid-pooled tokens; the mean of the tokens
    hides it. The token heads read it on held-out bags; with the labels shuffled they cannot."""
    from evals import probe_heads
    from evals import probe_metrics as pm

    rng = np.random.default_rng(0)
    n, tokens, dim = 300, 72, 16
    y = rng.integers(0, 2, n)
    t = rng.normal(size=(n, tokens, dim)).astype(np.float32)
    for i in np.flatnonzero(y):
        t[i, rng.choice(tokens, 2, replace=False), 0] += 6.0
    pooled = t.mean(1)
    tr, te = np.arange(n) < 200, np.arange(n) >= 200
    for labels, lo, hi in ((y, 0.9, 1.0), (rng.permutation(y), 0.0, 0.65)):
        predict = probe_heads.train_heads(kind, [(1e-2, 0.0)], pooled[tr], t[tr], labels[tr], 2, 30, 32, 0,
                                          standardize=True)  # as the probes ship
        acc = pm.balanced_accuracy(labels[te], predict(pooled[te], t[te])[0].argmax(1), 2)
        assert lo <= acc <= hi, (kind, acc)


def test_standardised_heads_read_a_channel_whatever_its_scale():
    """With `standardize` every channel is scaled by the training rows' statistics, so a
    head's predictions do not change when one channel is multiplied by 1,000 and another shifted;
    without it they do (the heads' per-token LayerNorm alone is not per-channel)."""
    from evals import probe_heads

    rng = np.random.default_rng(0)
    n, k, d = 64, 6, 8
    tokens = rng.normal(size=(n, k, d)).astype(np.float32)
    labels = (tokens[:, :, 0].max(1) > 1.0).astype(np.int64)
    pooled = tokens.max(1)
    warped_t = tokens.copy()
    warped_t[..., 1] *= 1000.0
    warped_t[..., 2] += 50.0
    warped_p = warped_t.max(1)
    for kind in ("linear", "attentive"):
        out = {}
        for on in (True, False):
            for name, (p, t) in {"plain": (pooled, tokens), "warped": (warped_p, warped_t)}.items():
                predict = probe_heads.train_heads(kind, [(1e-2, 0.0)], p[:48], t[:48], labels[:48], 2, 5, 16, 0,
                                                  standardize=on)
                out[on, name] = predict(p[48:], t[48:])
        assert np.allclose(out[True, "plain"], out[True, "warped"], atol=1e-4), kind
        assert not np.allclose(out[False, "plain"], out[False, "warped"], atol=1e-2), kind


def test_standardising_is_the_training_rows_statistics_applied_to_every_row(monkeypatch):
    """A standardised head is the unstandardised head on features scaled by the mean and standard
    deviation of the rows it trains on (not of the rows it predicts), and the probe config's
    `standardize` is what reaches it."""
    from evals import probe_heads
    from evals.config import ProbeConfig

    rng = np.random.default_rng(1)
    tokens = (rng.normal(size=(80, 6, 8)) * rng.uniform(0.1, 30, 8) + rng.normal(0, 20, 8)).astype(np.float16)
    pooled = tokens.astype(np.float32).max(1)
    labels = rng.integers(0, 2, 80)
    tr, te = slice(0, 60), slice(60, 80)
    t32 = tokens.astype(np.float64)
    mu_t, sd_t = t32[tr].reshape(-1, 8).mean(0), t32[tr].reshape(-1, 8).std(0) + 1e-6
    mu_p, sd_p = pooled[tr].astype(np.float64).mean(0), pooled[tr].astype(np.float64).std(0) + 1e-6
    by_hand_t = ((t32 - mu_t) / sd_t).astype(np.float32)
    by_hand_p = ((pooled - mu_p) / sd_p).astype(np.float32)
    for kind in ("linear", "attentive", "mil"):
        on = probe_heads.train_heads(kind, [(1e-2, 0.0)], pooled[tr], tokens[tr], labels[tr], 2, 3, 16, 0,
                                     standardize=True)
        off = probe_heads.train_heads(kind, [(1e-2, 0.0)], by_hand_p[tr], by_hand_t[tr], labels[tr], 2, 3, 16, 0,
                                      standardize=False)
        assert np.allclose(on(pooled[te], tokens[te]), off(by_hand_p[te], by_hand_t[te]), atol=1e-4), kind
    seen = []
    real = probe_heads.train_heads
    monkeypatch.setattr(probe, "train_heads", lambda *a, **k: seen.append(k["standardize"]) or real(*a, **k))
    split = np.array(["train"] * 60 + ["val"] * 20)
    for flag in (True, False):
        probe.fit_and_select("linear", ProbeConfig(lrs=[1e-2], weight_decays=[0.0], epochs=1, standardize=flag),
                             {"pooled": pooled, "tokens": tokens}, labels, split, 2)
    assert seen == [True, False]


def test_a_channel_constant_in_training_is_left_unscaled():
    """A channel with no spread on the training rows keeps its scale (its deviations elsewhere are
    not multiplied by a million)."""
    from evals import probe_heads

    x = np.ones((10, 3), np.float32)
    x[:, 1] = np.arange(10)
    scaler = probe_heads.ChannelScaler(x)
    assert scaler.std[0] == 1.0 and scaler.std[2] == 1.0 and scaler.std[1] > 2
    moved = torch.tensor([[3.0, 4.5, 1.0]])
    assert float(scaler(moved)[0, 0]) == 2.0 and float(scaler(moved)[0, 2]) == 0.0
    assert probe_heads.ChannelScaler(x, on=False)(moved) is moved
    off = probe_heads.ChannelScaler.identity()
    assert off(moved) is moved and not dict(off.named_buffers())  # nothing to save or load


def test_min_steps_trains_few_rows_for_more_epochs(monkeypatch):
    """With `min_steps` a head on few rows trains that many optimizer steps (more
    epochs), one on many rows its `epochs` as before; 0 leaves `epochs` alone. Counted on the
    optimizer itself, and the config key is what reaches it."""
    from evals import probe_heads
    from evals.config import ProbeConfig

    assert probe_heads.head_epochs(rows=164, batch=32, epochs=60, min_steps=2940) == 490   # 6 batches an epoch
    assert probe_heads.head_epochs(rows=1565, batch=32, epochs=60, min_steps=2940) == 60   # 49 x 60 >= 2940
    assert probe_heads.head_epochs(rows=164, batch=32, epochs=60, min_steps=0) == 60
    steps = []
    real = probe_heads._HeadAdamW.step
    monkeypatch.setattr(probe_heads._HeadAdamW, "step", lambda self: steps.append(1) or real(self))
    rng = np.random.default_rng(0)
    pooled, labels = rng.normal(size=(40, 8)).astype(np.float32), rng.integers(0, 2, 40)
    split = np.array(["train"] * 30 + ["val"] * 10)                 # 30 train rows: 2 batches of 16 an epoch
    for min_steps, want in ((0, 2 * 3), (25, 2 * 13)):
        steps.clear()
        probe.fit_and_select("linear", ProbeConfig(lrs=[1e-2], weight_decays=[0.0], epochs=3, batch_size=16,
                                                   min_steps=min_steps), {"pooled": pooled}, labels, split, 2)
        assert len(steps) == want, (min_steps, len(steps))


@pytest.mark.parametrize("kind", ["linear", "attentive", "mil"])
def test_several_encoders_grids_train_as_one_stack_as_each_alone(kind):
    """train_heads on a list of encoders' features: each encoder's heads predict what its grid trained
    alone predicts (the same start, batches and updates; float rounding apart), its own channel
    statistics included, and `encoder(e)` is that grid alone."""
    from evals import probe_heads

    rng = np.random.default_rng(0)
    n, k, d = 90, 6, 8
    toks = [(rng.normal(size=(n, k, d)) * rng.uniform(0.5, 20, d) + s).astype(np.float32) for s in (0.0, 5.0, -3.0)]
    pooled = [t.max(1) for t in toks]
    y = (toks[0][:, :, 0].max(1) > np.median(toks[0][:, :, 0].max(1))).astype(np.int64)
    grid = [(1e-2, 0.0), (3e-3, 0.1)]
    stack = probe_heads.train_heads(kind, grid, pooled, toks, y, 2, 4, 16, 3, standardize=True)
    together = stack(pooled, toks)                                                   # [E * G, n, C]
    assert together.shape == (3 * len(grid), n, 2)
    for e in range(3):
        alone = probe_heads.train_heads(kind, grid, pooled[e], toks[e], y, 2, 4, 16, 3, standardize=True)
        want = alone(pooled[e], toks[e])
        assert np.allclose(together[e * len(grid):(e + 1) * len(grid)], want, atol=1e-5), (kind, e)
        assert np.allclose(stack.encoder(e)(pooled[e], toks[e]), want, atol=1e-5), (kind, e)
    assert not np.allclose(together[:len(grid)], together[len(grid):2 * len(grid)], atol=1e-3)


@pytest.mark.parametrize("kind", ["linear", "attentive"])
def test_a_fit_scales_and_norms_its_rows_once_as_each_batch_would(kind):
    """train_heads prepares every training row once (probe_heads.prepared: the channel scalers and the
    heads' norm, in chunks): the heads read any batch of those rows exactly as the whole forward
    reads the raw batch, for one encoder and for a stack of two."""
    from evals import probe_heads

    rng = np.random.default_rng(1)
    toks = [(rng.normal(size=(50, 6, 8)) * rng.uniform(0.5, 20, 8) + s).astype(np.float32) for s in (0.0, 4.0)]
    pooled = [t.max(1) for t in toks]
    idx = torch.tensor([3, 41, 7, 19, 0])
    for stacked in (False, True):
        p, t = (pooled, toks) if stacked else (pooled[0], toks[0])
        scaler = probe_heads.ChannelScaler.stacked if stacked else probe_heads.ChannelScaler
        heads = probe_heads.make_heads(kind, 2 * (2 if stacked else 1), 8, 2)
        model = probe_heads.ScaledHeads(heads, scaler(p, True), scaler(t, True))

        def rows(x, part):
            return torch.from_numpy(np.stack([a[part] for a in x]) if stacked else x[part])
        P, T = probe_heads.prepared(model, lambda part: (rows(p, part), rows(t, part)), 50, int(stacked), chunk=7)
        pick = (slice(None), idx) if stacked else (idx,)
        with torch.no_grad():
            want = model(rows(p, slice(None))[pick], rows(t, slice(None))[pick])
            got = heads.read(*(x[pick] if x is not None else None for x in (P, T)))
        assert torch.equal(got, want), (kind, stacked)
        assert (P is None) == (kind != "linear") and (T is None) == (kind == "linear")
        # what was prepared is the scaled, then normed, rows (written out here, not through `prepare`)
        raw, sc = (rows(p, slice(None)), model.scale_p) if kind == "linear" else (rows(t, slice(None)), model.scale_t)
        shape = ((2, 1) if kind == "linear" else (2, 1, 1)) + (8,) if stacked else (8,)
        ref = torch.nn.functional.layer_norm((raw - sc.mean.view(shape)) / sc.std.view(shape), (8,))
        assert torch.allclose(P if kind == "linear" else T, ref, atol=1e-6), (kind, stacked)


def test_a_checkpoints_weights_and_identity_come_from_one_file(tmp_path, monkeypatch):
    """latest.pt is resolved once. A save that lands between reading the weights
    and naming them (`make probe CKPT=.../latest.pt` while training runs) must not record step 1's
    weights under step 2's name."""
    from evals import features
    from octfm import fsio
    from train import checkpoint
    from train.config import TrainConfig
    from train.model import Encoder

    cfg = config.load(TrainConfig, "configs/pretrain_smoke.yaml", ["model.dim=32", "model.depth=1", "model.heads=2"])
    state = lambda step: {"config": config.to_dict(cfg), "step": step,  # noqa: E731
                          "target": Encoder(cfg.model, cfg.data.input_shape).state_dict()}
    ckpts = str(tmp_path / "checkpoints")
    checkpoint.save(state(1), ckpts, 1)
    real = fsio.read_bytes

    def read_then_a_save_lands(path):
        out = real(path)
        if path.endswith(".pt") and len(checkpoint.list_steps(ckpts)) == 1:
            checkpoint.save(state(2), ckpts, 2)
        return out

    monkeypatch.setattr(fsio, "read_bytes", read_then_a_save_lands)
    _, _, ident = features.checkpoint_encoder(f"{ckpts}/latest.pt")
    assert (ident["step"], ident["name"]) == (1, "step_0000001.pt")

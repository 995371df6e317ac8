"""The learning check's head choice on val: the simplest head kind within one
paired-bootstrap standard error of the best, not the best val score outright; and the headline's
one kind for both encoders, chosen on their mean val (docs/history/learning-check.md)."""
import dataclasses

import numpy as np
import pytest

from check import probes as check_probes, result_rows, verdicts
from evals import probe
from evals import probe_metrics as pm


def predictions(y: np.ndarray, wrong: np.ndarray, k: int = 2) -> np.ndarray:
    """Class probabilities that are right everywhere but at `wrong` (there the next class)."""
    pred = np.where(wrong, (y + 1) % k, y)
    return np.eye(k)[pred] * 0.8 + 0.2 / k


def fitted_heads(y, groups, va, wrong_linear, wrong_attentive) -> dict:
    out = {}
    for kind, wrong in (("linear", wrong_linear), ("attentive", wrong_attentive)):
        prob = predictions(y, wrong)
        out[kind] = (probe.val_rank(pm.balanced_accuracy(y[va], prob[va].argmax(1), 2),
                                    pm.macro_auroc(y[va], prob[va])), prob)
    return out


def test_a_head_within_one_standard_error_of_the_best_gives_way_to_the_simpler():
    rng = np.random.default_rng(0)
    n = 300                                            # 150 val participants, one row each, then 150 others
    y, groups = rng.integers(0, 2, n), np.array([f"p{i}" for i in range(n)])
    va = np.arange(n) < 150
    base = rng.random(n) < 0.35                        # the linear head wrong on about a third of val
    other = np.roll(base, 7)                           # the attentive head as often wrong, on other people
    close = other.copy()
    close[np.flatnonzero(other & va)[:3]] = False      # and right on 3 more participants: within noise
    far = other.copy()
    far[np.flatnonzero(other & va)[:40]] = False       # 40 more: well beyond one standard error

    near = fitted_heads(y, groups, va, base, close)
    assert max(near, key=lambda h: near[h][0]) == "attentive"                # the best val score
    assert check_probes.one_se_choice(near, y, groups, va, 2, 200, 0) == "linear"
    clear = fitted_heads(y, groups, va, base, far)
    assert check_probes.one_se_choice(clear, y, groups, va, 2, 200, 0) == "attentive"
    better_simple = fitted_heads(y, groups, va, close, base)
    assert check_probes.one_se_choice(better_simple, y, groups, va, 2, 200, 0) == "linear"
    se = pm.paired_difference_ci(y[va], near["attentive"][1][va], near["linear"][1][va], groups[va], 2, 200, 0)
    assert 0 < se["difference"] <= se["difference_se"] < 0.1


def test_a_label_fraction_trains_as_many_steps_as_its_full_fold(monkeypatch):
    """Heads on folds narrowed to a label fraction train at least the optimizer steps
    `epochs` take on each fold's own full train rows (held-out scanners: folds of different sizes),
    never fewer than `min_steps`; without the full folds, `epochs` as they are."""
    from evals.config import ProbeConfig

    rng = np.random.default_rng(0)
    n = 200
    rows = [{"label": 3 * (i % 2), "split": ["train", "train", "val", "test"][i % 4], "participant_id": f"p{i}"}
            for i in range(n)]
    split = np.array([r["split"] for r in rows])
    small, large = (split == "train") & (np.arange(n) < 60), split == "train"      # 30 and 100 train rows
    fs = [("small", small, split == "val", split == "test"), ("large", large, split == "val", split == "test")]
    keep = np.arange(n) % 8 == 0                                                   # a fraction: 15 and 25 rows
    narrow = [(name, tr & keep, va, te) for name, tr, va, te in fs]
    seen = []
    real = probe.fit_and_select_all
    monkeypatch.setattr(probe, "fit_and_select_all", lambda kind, cfg, *a: seen.append(cfg.min_steps) or real(kind, cfg, *a))
    feats = {"pooled": rng.normal(size=(n, 4)).astype(np.float32)}
    cfg = ProbeConfig(heads=["linear"], lrs=[1e-2], weight_decays=[0.0], epochs=2, batch_size=16, bootstrap=20)
    check_probes.fit_encoder(cfg, feats, "diabetic", rows, narrow, full=fs)
    assert seen == [2 * 2, 2 * 7]                                                  # ceil(30/16), ceil(100/16) batches
    seen.clear()
    check_probes.fit_encoder(cfg, feats, "diabetic", rows, narrow)
    assert seen == [0, 0]
    seen.clear()
    check_probes.fit_encoder(dataclasses.replace(cfg, min_steps=9), feats, "diabetic", rows, narrow, full=fs)
    assert seen == [9, 14]


def _draw_fits(n_draws: int):
    """Rows, folds and fits of a pretrained encoder and `n_draws` random-init ones on random
    features (two heads each, the scanners' four folds)."""
    from evals.config import ProbeConfig

    rng = np.random.default_rng(1)
    n = 240
    rows = [{"label": 3 * ((i // 2) % 2), "split": ["train", "train", "val", "test"][(i // 2) % 4],
             "participant_id": f"p{i // 2}", "device": f"d{(i // 8) % 4}"} for i in range(n)]
    cfg = ProbeConfig(heads=["linear", "attentive"], lrs=[1e-2], weight_decays=[0.0], epochs=2, batch_size=16,
                      bootstrap=50, token_pool=(1, 1, 1))
    fs = check_probes.folds(rows, "scanners")

    def fit(shift):
        pooled = rng.normal(size=(n, 4)).astype(np.float32)
        pooled[:, 0] += shift * np.array([r["label"] > 0 for r in rows])
        feats = {"pooled": pooled, "tokens": np.repeat(pooled[:, None], 3, 1)}
        return check_probes.fit_encoder(cfg, feats, "diabetic", rows, fs)

    return rows, fs, fit(1.5), [fit(0.3 * d) for d in range(n_draws)]


def _by_hand(rows: list[dict], a: np.ndarray, b: np.ndarray | None, mask: np.ndarray, n_boot: int, seed: int) -> dict:
    """The binary task's test balanced accuracy of a (minus b's), with its interval, by an explicit
    loop over participant resamples: the formulas from before the random-init draws, written out, not through
    check_probes' own scoring (score and paired share it with the rows under test)."""
    y, groups = check_probes.task_arrays("diabetic", rows)[0][mask], np.array([r["participant_id"] for r in rows])[mask]
    a, b = a[mask], None if b is None else b[mask]

    def value(i):
        minus = 0 if b is None else pm.balanced_accuracy(y[i], b[i].argmax(1), 2)
        return pm.balanced_accuracy(y[i], a[i].argmax(1), 2) - minus

    vals = [value(i) for i in pm.participant_resamples(groups, n_boot, seed)]
    return {"value": value(np.arange(len(y))), "ci95": pm.ci95(vals), "se": float(np.std(vals))}


def test_one_random_draw_gives_the_rows_it_gave_before_the_draws():
    """With one random-init draw every row is what the formulas before it gave (each
    encoder's test balanced accuracy and the paired difference, by a participant-resample loop
    written out here, and the single score's interval as probe_metrics.bootstrap_ci gives it; the
    fit's own val and heads), to the last digit, and no per-draw rows are added."""
    rows, fs, pre, (rand,) = _draw_fits(1)
    te, listed = check_probes.tested_rows(fs), {"pretrained": pre, "random_init": [rand]}
    y, groups = check_probes.task_arrays("diabetic", rows)[0], np.array([r["participant_id"] for r in rows])
    out = check_probes.compare("diabetic", rows, listed, fs, 50, 0)["comparisons"]
    for kind, c in out.items():
        p, r = pre[kind], rand[kind]
        assert c["pretrained"] == _by_hand(rows, p["prob"], None, te, 50, 0)["value"]
        ci = pm.bootstrap_ci(y[te], r["prob"][te], groups[te], 2, 50, 0)["balanced_accuracy_ci95"]
        assert c["random_init_ci95"] == ci
        before = _by_hand(rows, p["prob"], r["prob"], te, 50, 0)
        assert (c["difference"], c["difference_ci95"], c["difference_se"]) == tuple(before.values())
        assert c["val"] == {"pretrained": p["val"], "random_init": r["val"]}
        assert c["random_head"] == "/".join(sorted(set(r["heads"]))) and "random_draws" not in c
    for name, _, _, tm in fs:
        row = check_probes.per_scanner("diabetic", rows, listed, fs, 50, 0)[name]
        assert row["random_init"] == _by_hand(rows, rand[check_probes.CHOSEN]["prob"], None, tm, 50, 0)["value"]
    point = check_probes.curve_point("diabetic", rows, listed, fs, 50, 0)["pretrained_minus_random_init"]
    before = _by_hand(rows, pre[check_probes.CHOSEN]["prob"], rand[check_probes.CHOSEN]["prob"], te, 50, 0)
    assert (point["difference"], point["difference_ci95"]) == (before["value"], before["ci95"])


def test_random_init_rows_are_the_mean_of_their_draws():
    """The random-init score is the mean of the draws' scores, pretrained minus it
    the mean of pretrained minus each; each draw's own row is kept, draw 1's the one-draw row."""
    rows, fs, pre, rand = _draw_fits(3)
    c = check_probes.compare("diabetic", rows, {"pretrained": pre, "random_init": rand}, fs, 50, 0)
    chosen = c["comparisons"][check_probes.CHOSEN]
    each = chosen["random_draws"]
    assert [d["draw"] for d in each] == [1, 2, 3]
    assert len({d["random_init"] for d in each}) > 1                     # the draws differ
    assert abs(chosen["random_init"] - np.mean([d["random_init"] for d in each])) < 1e-12
    assert abs(chosen["difference"] - np.mean([d["difference"] for d in each])) < 1e-12
    assert abs(chosen["difference"] - (chosen["pretrained"] - chosen["random_init"])) < 1e-12
    lo, hi = chosen["difference_ci95"]
    assert lo <= chosen["difference"] <= hi
    one = check_probes.compare("diabetic", rows, {"pretrained": pre, "random_init": rand[0]}, fs, 50, 0)
    first = one["comparisons"][check_probes.CHOSEN]
    assert each[0]["random_init"] == first["random_init"] and each[0]["difference"] == first["difference"]
    assert each[0]["difference_ci95"] == first["difference_ci95"] and each[0]["head"] == first["random_head"]
    assert chosen["random_head"] == "/".join(sorted({h for f in rand for h in f[check_probes.CHOSEN]["heads"]}))
    assert all("random_draws" not in c["comparisons"][k] for k in ("linear", "attentive"))
    scanners = check_probes.per_scanner("diabetic", rows, {"pretrained": pre, "random_init": rand}, fs, 50, 0)
    for name, _, _, te in fs:
        alone = [check_probes.score("diabetic", rows, f[check_probes.CHOSEN]["prob"], te, 50, 0)["balanced_accuracy"]
                 for f in rand]
        assert abs(scanners[name]["random_init"] - np.mean(alone)) < 1e-12


def _designed_heads(monkeypatch, wrong: dict) -> None:
    """probe.fit_and_select_all replaced by heads set here: each encoder's features name it (`tag`), and
    its head of a kind errs at wrong[tag][kind] (the lr x wd choice is not what these tests are about)."""
    def fit_and_select_all(kind, cfg, feats, y, split, k, tr, va):
        probs = [predictions(y, wrong[f["tag"]][kind], k) for f in feats]
        return [({"val_balanced_accuracy": pm.balanced_accuracy(y[va], p[va].argmax(1), k),
                  "val_auroc": pm.macro_auroc(y[va], p[va])}, p) for p in probs]
    monkeypatch.setattr(probe, "fit_and_select_all", fit_and_select_all)


def _participants() -> list[dict]:
    """400 participants, one row each: 150 val, 150 test, 100 train; study groups drawn at random."""
    split = ["val"] * 150 + ["test"] * 150 + ["train"] * 100
    return [{"label": int(lab), "split": split[i], "participant_id": f"p{i}"}
            for i, lab in enumerate(np.random.default_rng(3).integers(0, 4, 400))]


def _headline(wrong: dict):
    """result_rows.headline_probes for a pretrained encoder and two random-init draws, tagged in
    that order by `wrong`'s keys, on _participants, and the verdict read of it."""
    from evals.config import ProbeConfig

    feats = {name: {"tag": tag} for name, tag in zip(["pretrained", "random_init", "random_init_2"], wrong)}
    head = result_rows.headline_probes(ProbeConfig(heads=["linear", "attentive"], bootstrap=200), _participants(),
                                feats, "splits", 200)
    result = {"tasks": head["tasks"], "target": 0.10, "protocol": "splits", "cue": "lesions", "random_draws": 2}
    return head, verdicts.verdict(result)


def _erring(n: int, seed: int, share: float) -> np.ndarray:
    return np.random.default_rng(seed).random(n) < share


def test_the_headline_reads_both_encoders_through_the_kind_chosen_for_the_pair(monkeypatch):
    """The one-SE rule keeps the pretrained encoder's linear head (its attentive head
    better on val, within one standard error) and gives random init the attentive one; the
    verdict reads both through one kind, here attentive, and its row is the attentive heads' row."""
    n, va = 400, np.arange(400) < 150
    base = _erring(n, 0, 0.35)
    close = np.roll(base, 7)
    close[np.flatnonzero(close & va)[:3]] = False               # 3 more right on val: within one SE
    wrong = {"pre": {"linear": base, "attentive": close},
             **{f"r{d}": {"linear": base | _erring(n, 10 + d, 0.3), "attentive": np.roll(base, 11 + d)}
                for d in (1, 2)}}                               # random init: attentive far better on val
    _designed_heads(monkeypatch, wrong)
    head, verdict = _headline(wrong)
    t = head["tasks"]["diabetic"]["comparisons"]
    mixed, attentive = t[check_probes.CHOSEN], t["attentive"]
    assert (mixed["pretrained_head"], mixed["random_head"]) == ("linear", "attentive")    # each encoder's own choice
    assert f"diabetic (attentive) {attentive['difference']:+.3f} " in verdict
    assert f"{mixed['difference']:+.3f}" not in verdict
    same = t[check_probes.SAME_KIND]
    assert same["pretrained_head"] == same["random_head"] == "attentive"
    for key in ("pretrained", "random_init", "difference", "difference_ci95", "difference_se", "val"):
        assert same[key] == attentive[key]
    assert [d["head"] for d in same["random_draws"]] == ["attentive", "attentive"]


def test_random_init_draws_count_once_together_in_the_pairs_choice(monkeypatch):
    """The pair's score of a kind is the mean of pretrained's val and random init's (its
    draws' mean), a half each, not a mean over three encoders; the choice and its scores are recorded."""
    n, va = 400, np.arange(400) < 150
    base = _erring(n, 0, 0.3)
    worse = base.copy()
    worse[np.flatnonzero(~base & va)[:30]] = True               # pretrained: linear 30 val rows better
    wrong = {"pre": {"linear": base, "attentive": worse}}
    for d in (1, 2):                                             # each draw: attentive 18 val rows better
        b = _erring(n, 20 + d, 0.3)
        w = b.copy()
        w[np.flatnonzero(~b & va)[:18]] = True
        wrong[f"r{d}"] = {"linear": w, "attentive": b}
    _designed_heads(monkeypatch, wrong)
    head, verdict = _headline(wrong)
    y, _, _, k = check_probes.task_arrays("diabetic", _participants())
    val = {tag: {kind: pm.balanced_accuracy(y[va], predictions(y, m, k)[va].argmax(1), k) for kind, m in kinds.items()}
           for tag, kinds in wrong.items()}
    pair = {kind: (val["pre"][kind] + (val["r1"][kind] + val["r2"][kind]) / 2) / 2 for kind in ("linear", "attentive")}
    three = {kind: np.mean([v[kind] for v in val.values()]) for kind in ("linear", "attentive")}
    assert pair["linear"] > pair["attentive"] and three["attentive"] > three["linear"]   # the case tells them apart
    assert "diabetic (linear) " in verdict
    same = head["tasks"]["diabetic"]["comparisons"][check_probes.SAME_KIND]
    assert same["pretrained_head"] == same["random_head"] == "linear"
    assert same["pair_val"] == [pytest.approx(pair)]
    assert [d["head"] for d in same["random_draws"]] == ["linear", "linear"]

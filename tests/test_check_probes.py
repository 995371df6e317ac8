"""The learning check's head choice on val (decision 8): the simplest head kind within one
paired-bootstrap standard error of the best, not the best val score outright."""
import numpy as np

from evals import check_probes, probe
from evals import probe_metrics as pm


def predictions(y: np.ndarray, wrong: np.ndarray) -> np.ndarray:
    """Binary class probabilities that are right everywhere but at `wrong`."""
    pred = np.where(wrong, 1 - y, y)
    return np.eye(2)[pred] * 0.8 + 0.1


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


def test_a_label_fraction_trains_as_many_steps_as_the_full_split():
    """Decision 32: the label-efficiency curve's heads get the full train split's optimizer steps
    (`epochs` x its batches, the largest fold's where there are several), so 10% of the labels do
    not mean a tenth of the updates; all labels keep `epochs` exactly."""
    from evals.config import ProbeConfig

    n = 100
    tr = np.arange(n) < 70                                   # 70 train rows: 3 batches of 32
    fs = [("a", tr, ~tr, ~tr), ("b", np.arange(n) < 40, ~tr, ~tr)]
    cfg = check_probes.steps_matched(ProbeConfig(epochs=5, batch_size=32), fs)
    assert cfg.min_steps == 15 and cfg.epochs == 5
    assert check_probes.steps_matched(ProbeConfig(epochs=5, batch_size=32, min_steps=99), fs).min_steps == 99

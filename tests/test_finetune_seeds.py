"""check/finetune_seeds.py: fine-tuning runs over seeds, read back and paired (issue 41, item 4)."""
import numpy as np
import pytest

from check import finetune_seeds as fs
from evals import probe
from evals import probe_metrics as pm
from manifests.aireadi import TASKS


def _fake_runs(folder, rows, y, quality: dict, seeds=(0, 1, 2)):
    """npz runs whose predictions are right on a fixed share of rows (quality[init] per seed)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for s in seeds:
        for init in fs.INITS:
            right = rng.random(len(y)) < quality[init][s]
            pred = np.where(right, y, 1 - y)
            np.savez(folder / f"{fs.run_name(init, s)}.npz", prob=np.eye(2)[pred] * 0.8 + 0.1,
                     relpath=np.array([r["relpath"] for r in rows]), val=0.5, best_epoch=3, epochs=9, seconds=1.0)


def test_scores_pair_the_seeds_and_the_two_folders(tiny_cache, tmp_path):
    rows = probe.labelled_rows(str(tiny_cache), 0, shuffle=False)
    y = np.array([TASKS["diabetic"]["map"](r["label"]) for r in rows])
    te = np.array([r["split"] == "test" for r in rows])
    groups = np.array([r["participant_id"] for r in rows])
    _fake_runs(tmp_path / "a", rows, y, {"pretrained": [0.6, 0.7, 0.8], "random": [0.5, 0.5, 0.5]})
    _fake_runs(tmp_path / "b", rows, y, {"pretrained": [0.9, 0.9, 0.9], "random": [0.6, 0.6, 0.6]})
    res = fs.score_folders(str(tiny_cache), {"a": tmp_path / "a", "b": tmp_path / "b"}, n_boot=50)

    def ba(folder, init, s):
        with np.load(tmp_path / folder / f"{fs.run_name(init, s)}.npz") as z:
            return pm.balanced_accuracy(y[te], z["prob"][te].argmax(1), 2)

    for folder in ("a", "b"):
        f = res["folders"][folder]
        assert f["seeds"] == [0, 1, 2]
        diffs = [ba(folder, "pretrained", s) - ba(folder, "random", s) for s in range(3)]
        assert [r["difference"]["difference"] for r in f["per_seed"]] == pytest.approx(diffs)
        assert f["mean"]["difference"]["difference"] == pytest.approx(np.mean(diffs))
        assert f["per_seed"][1]["pretrained"]["test"] == pytest.approx(ba(folder, "pretrained", 1))
        resampled = f["mean"]["difference_seeds_resampled"]       # decision 54: the seeds drawn too
        assert resampled["difference"] == pytest.approx(np.mean(diffs)) and resampled["per_seed"] == pytest.approx(diffs)
        assert "Mean difference with the seeds resampled as well as the participants: " + fs._d(resampled) in fs.report(res)
    change = np.mean([(ba("b", "pretrained", s) - ba("b", "random", s)) - (ba("a", "pretrained", s) - ba("a", "random", s))
                      for s in range(3)])
    assert res["change"]["difference"]["difference"] == pytest.approx(change)
    assert res["change"]["random"]["difference"] == pytest.approx(np.mean([ba("b", "random", s) - ba("a", "random", s)
                                                                           for s in range(3)]))
    lo, hi = res["change"]["pretrained"]["difference_ci95"]
    assert lo <= res["change"]["pretrained"]["difference"] <= hi
    assert res["test_participants"] == len(set(groups[te]))
    assert "| mean |" in fs.report(res)


def test_a_folder_without_a_pair_of_runs_is_refused(tiny_cache, tmp_path):
    rows = probe.labelled_rows(str(tiny_cache), 0, shuffle=False)
    y = np.array([TASKS["diabetic"]["map"](r["label"]) for r in rows])
    _fake_runs(tmp_path / "a", rows, y, {"pretrained": [0.6], "random": [0.5]}, seeds=(0,))
    (tmp_path / "a" / "random_s0.npz").rename(tmp_path / "a" / "random_s0.npz.tmp")  # a run killed while saving
    with pytest.raises(Exception, match="no seed with a run from both inits"):
        fs.score_folders(str(tiny_cache), {"a": tmp_path / "a"}, n_boot=10)


def test_runs_of_another_cache_are_refused_by_name(tiny_cache, tmp_path):
    rows = probe.labelled_rows(str(tiny_cache), 0, shuffle=False)
    y = np.array([TASKS["diabetic"]["map"](r["label"]) for r in rows])
    _fake_runs(tmp_path / "a", rows[1:], y[1:], {"pretrained": [0.6] * 3, "random": [0.5] * 3})
    with pytest.raises(Exception, match="pretrained_s0.npz: its rows are not the cache's labelled rows"):
        fs.score_folders(str(tiny_cache), {"a": tmp_path / "a"}, n_boot=10)


def test_a_mean_over_seeds_is_one_contrast_on_each_resample():
    """contrast_ci: weights 1/n and -1/n give the mean of the paired differences, and its interval
    is no wider than the widest single seed's (the seeds' errors partly average out)."""
    rng = np.random.default_rng(1)
    groups = np.repeat(np.arange(40), 3)
    y = rng.integers(0, 2, len(groups))
    probs = [np.eye(2)[np.where(rng.random(len(y)) < q, y, 1 - y)] for q in (0.8, 0.75, 0.6, 0.55)]
    one = [pm.paired_difference_ci(y, probs[i], probs[i + 2], groups, 2, 300, 0) for i in (0, 1)]
    mean = pm.contrast_ci(y, [(0.5, probs[0]), (0.5, probs[1]), (-0.5, probs[2]), (-0.5, probs[3])], groups, 2, 300, 0)
    ba = [pm.balanced_accuracy(y, p.argmax(1), 2) for p in probs]
    assert mean["difference"] == pytest.approx((ba[0] + ba[1] - ba[2] - ba[3]) / 2)
    width = mean["difference_ci95"][1] - mean["difference_ci95"][0]
    assert width <= max(d["difference_ci95"][1] - d["difference_ci95"][0] for d in one)


def test_an_unknown_init_is_refused_by_its_flag_before_any_run(tmp_path):
    with pytest.raises(Exception, match="--inits scratch: each one of pretrained, random"):
        fs.main(["run", "--ckpt", "none.pt", "--cache", "none", "--out", str(tmp_path / "o"), "--inits", "scratch"])
    with pytest.raises(Exception, match="--inits"):
        fs.run_seeds("none.pt", "none", tmp_path / "o", 0.1, [0], inits=())
    assert not (tmp_path / "o").exists()

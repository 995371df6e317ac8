"""The learning-check cohort carries its class only in local structure: a logistic regression on
per-volume global intensity statistics of the cached volumes is at chance on held-out
participants, while a lesion-aware statistic (a count of dark and bright blobs) on the same
volumes, with the same regression and split, does better, so the test can fail."""
import pytest

from conftest import run_cli
from evals.cohort_screen import statistics_scores
from ingest import synth


@pytest.fixture(scope="session")
def lesion_cohort(tmp_path_factory):
    """The cohort generator at test size (100 participants, both eyes, four devices), cached
    by the real `cache.build` at the learning check's shape."""
    root = tmp_path_factory.mktemp("cohort")
    synth.generate(root / "ds", synth.SynthConfig(participants=100, scale=4, seed=7, lesions=1.0, bad_files=False,
                                                  unlabeled=0))
    r = run_cli("cache.build", "--source", str(root / "ds"), "--cache", str(root / "cache"), "--no-progress",
                "preprocess.target_shape=[32,128,128]")
    assert r.returncode == 0, r.stderr
    return root


def test_label_is_local_not_global(lesion_cohort):
    res = statistics_scores(str(lesion_cohort / "cache"))
    assert res["participants"] == 100 and res["devices"] == 4
    print(f"held-out balanced accuracy: global statistics {res['global']:.3f}, lesion counts {res['counter']:.3f}")
    assert res["global"] < 0.58                 # chance is 0.5 (about 225 volumes)
    assert res["counter"] > res["global"] + 0.05


def test_planted_cue_marks_positive_crops_only():
    """The screen's planted cube (evals/cohort_screen.py) brightens 8 x 16 x 16 voxels of each
    positive crop and leaves negative crops as they were."""
    import torch

    from evals.cohort_screen import Planted

    class Crops:
        def __getitem__(self, key):
            return {"x": torch.full((1, 32, 96, 96), 100, dtype=torch.uint8), "aug": torch.ones(2)}

    ds = Planted(Crops(), [0, 1], amp=50)
    neg, pos = ds[(0, 0)], ds[(0, 1)]
    assert (neg["x"] == 100).all() and neg["y"] == 0
    assert int((pos["x"] == 150).sum()) == 8 * 16 * 16 and int((pos["x"] == 100).sum()) == 32 * 96 * 96 - 8 * 16 * 16
    assert pos["y"] == 1 and torch.equal(ds[(0, 1)]["x"], pos["x"])      # the same place for the same key


def test_cohort_screen_end_to_end(lesion_cohort, tmp_path):
    """`python -m evals.cohort_screen` on the test cohort (its statistics are the test above):
    a short supervised reference (with a planted cue, which its scoring plants too) and its
    own-head scores land in screen.json, and the verdict line is printed."""
    import json

    r = run_cli("evals.cohort_screen", "--cache", str(lesion_cohort / "cache"), "--out", str(tmp_path / "s"),
                "--steps", "4", "--plant", "60", "--no-stats", "batch_size=2", "data.workers=0")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "s" / "screen.json").read_text())
    assert "statistics" not in res
    assert 0.0 <= res["supervised"]["val"] <= 1.0 and res["supervised"]["steps"] == 4 and res["plant"] == 60
    ok = res["supervised"]["val"] >= 0.65
    assert r.stdout.strip().splitlines()[-1] == res["verdict"]
    assert res["verdict"].startswith("cohort-screen: QUALIFIES" if ok else "cohort-screen: does not qualify")

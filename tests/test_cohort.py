"""The learning-check cohort carries its class only in local structure: a logistic regression on
per-volume global intensity statistics of the cached volumes is at chance on held-out
participants, while a lesion-aware statistic (a count of dark and bright blobs) on the same
volumes, with the same regression and split, does better, so the test can fail."""
import numpy as np
import pandas as pd
import pytest
from scipy import ndimage
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score
from sklearn.model_selection import GroupKFold, cross_val_predict
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from cache import store
from conftest import run_cli
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


def global_statistics(vol: np.ndarray) -> list[float]:
    return [vol.mean(), vol.std(), *np.percentile(vol, [1, 5, 25, 50, 75, 95, 99])]


def lesion_counts(vol: np.ndarray) -> list[float]:
    """Blobs brighter / darker than their en-face neighbourhood inside the retina's mid-grey
    band of the central crop: smoothing across frames and columns only removes the layers
    (smooth there) and keeps local lesions."""
    c = vol[:, 16:112, 16:112]
    background = ndimage.gaussian_filter(c, (4, 0.7, 10))
    d = ndimage.gaussian_filter(c, (1, 1, 1.5)) - background
    band = (background > 90) & (background < 200)
    out = []
    for mask in (d > 25, d > 30, d > 35, d < -30, d < -35, d < -40, d < -45):
        lab, _ = ndimage.label(mask & band)
        out.append(np.log1p((np.bincount(lab.ravel())[1:] >= 6).sum()))
    return out


def held_out_score(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> float:
    """Balanced accuracy of predictions for held-out participants (5 folds over participants,
    so every volume is scored by a model that never saw its participant)."""
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, class_weight="balanced"))
    pred = cross_val_predict(model, x, y, groups=groups, cv=GroupKFold(5))
    return balanced_accuracy_score(y, pred)


def test_label_is_local_not_global(lesion_cohort):
    cache = lesion_cohort / "cache"
    df = pd.read_parquet(cache / "manifest.parquet")
    df = df[df.status == "ok"].reset_index(drop=True)
    assert df.participant_id.nunique() == 100 and df.device.nunique() == 4
    vols = [store.read_volume(str(cache), v).astype(np.float32) for v in df.volume]
    g = np.array([global_statistics(v) for v in vols])
    les = np.array([lesion_counts(v) for v in vols])
    y = (df.label >= 2).astype(int).to_numpy()                        # the binary task: diabetic
    groups = df.participant_id.to_numpy()
    g_score, les_score = held_out_score(g, y, groups), held_out_score(les, y, groups)
    print(f"held-out balanced accuracy: global statistics {g_score:.3f}, lesion counts {les_score:.3f}")
    assert g_score < 0.58                       # chance is 0.5 (about 225 volumes)
    assert les_score > g_score + 0.05

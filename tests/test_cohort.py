"""The learning-check cohort's generator (check/cohort.py, ingest/synth.py): no column of its tables but
the label predicts the label, the same bytes whatever the workers, and a lesion table that points at
the lesions it drew."""
import dataclasses

import pytest

from check import cohort
from ingest import phantom, synth


def _held_out_lookup_score(keys: list, labels: list, groups: list, folds: int = 5) -> float:
    """Balanced accuracy of predicting the label from one key per participant by looking it up in
    the other folds' participants (the majority label of the key there; unseen keys: the overall
    majority): what any rule that reads this one column could get."""
    from collections import Counter

    import numpy as np
    from sklearn.metrics import balanced_accuracy_score

    people = np.random.default_rng(0).permutation(sorted(set(groups)))  # folds unrelated to any column
    fold = {p: i % folds for i, p in enumerate(people)}
    pred = []
    for k, g in zip(keys, groups):
        seen = [(kk, y) for kk, y, gg in zip(keys, labels, groups) if fold[gg] != fold[g]]
        same = Counter(y for kk, y in seen if kk == k)
        pred.append((same or Counter(y for _, y in seen)).most_common(1)[0][0])
    return float(balanced_accuracy_score(np.array(labels), np.array(pred)))


@pytest.mark.slow  # a cohort and a classifier per table column, about 16 s: the heavy lane
def test_no_table_column_but_the_label_predicts_it(tmp_path):
    """No column of the generated participants.tsv or manifest.tsv predicts study_group above
    chance (4 classes: 0.25), neither by its value nor, for whole numbers, by its value modulo 2-8
    (the age once read as 40 + 7i mod 40 and the label as i mod 4, and the ID as 1001 + i)."""
    import pandas as pd

    synth.generate(tmp_path / "ds", synth.SynthConfig(participants=400, seed=3, bad_files=False, unlabeled=0,
                                                      placeholders=True))
    people = pd.read_csv(tmp_path / "ds" / "participants.tsv", sep="\t", dtype=str)
    files = pd.read_csv(tmp_path / "ds" / "retinal_oct" / "manifest.tsv", sep="\t", dtype=str)
    table = files.merge(people, on="participant_id", how="left")
    label, groups = table.study_group.tolist(), table.participant_id.tolist()
    scores = {}
    for col in table.columns.drop("study_group"):
        values = table[col].fillna("").tolist()
        scores[col] = _held_out_lookup_score(values, label, groups)
        if all(v.isdigit() for v in values):
            for m in range(2, 9):
                scores[f"{col} mod {m}"] = _held_out_lookup_score([int(v) % m for v in values], label, groups)
    worst = max(scores, key=scores.get)
    print({k: round(v, 3) for k, v in sorted(scores.items(), key=lambda kv: -kv[1])[:8]})
    assert scores[worst] < 0.32, f"{worst} predicts the label: held-out balanced accuracy {scores[worst]:.3f}"


def _tree_bytes(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generator_bytes_do_not_depend_on_workers(tmp_path):
    """The random numbers are drawn in one stream in the caller; a pool of processes renders and
    writes the volumes: the same tree, byte for byte, as in one process (lesions, the layers cue,
    a JPEG 2000 scanner (participant 3, a Cirrus) and a Spectralis radial disc scan included)."""
    cfg = dataclasses.replace(cohort.COHORT, participants=6, scale=16, layers=0.2)
    synth.generate(tmp_path / "one", cfg, workers=0)
    synth.generate(tmp_path / "pool", cfg, workers=2)
    one, pool = _tree_bytes(tmp_path / "one"), _tree_bytes(tmp_path / "pool")
    assert list(one) == list(pool) and len(one) == 3 + 6 * 2 + 1  # three tables, both eyes, one radial scan
    assert [k for k in one if one[k] != pool[k]] == []
    assert synth.default_workers(dataclasses.replace(cfg, participants=synth.POOL_FROM - 1)) == 0


def test_the_lesion_table_points_at_the_voxels_each_lesion_changed():
    """lesion_table's centres, mapped to voxels as the token probe maps them, land where the
    rendered volume differs from the same eye without lesions, brighter for a focus and darker
    for a cyst."""
    import numpy as np

    rng = np.random.default_rng(5)
    shape = (32, 128, 96)
    draws = phantom.draw_volume(shape, rng)
    eye = phantom.sample_eye(3, rng, lesions=1.0)
    plain = phantom.render_volume(shape, draws, "L", 3, 0.0, dataclasses.replace(eye, lesions=()))
    marked = phantom.render_volume(shape, draws, "L", 3, 0.0, eye)
    diff = marked.astype(int) - plain.astype(int)
    table = phantom.lesion_table(draws, "L", 3, 0.0, eye)
    assert len(table) == len(eye.lesions) >= 3
    right = 0
    for les in table:
        f = round((les["y"] + 1) / 2 * (shape[0] - 1))
        c = round((les["x"] + 1) / 2 * (shape[2] - 1))
        r = int(les["z"] * shape[1])
        right += np.sign(diff[f, r, c]) == (1 if les["kind"] == "focus" else -1)
    assert right >= len(table) - 1, (right, table)
    assert not diff[:, :30].any()  # lesions sit in the inner retina: the vitreous above is untouched


def test_the_cohort_writes_its_lesion_table(tmp_path):
    import pandas as pd

    cfg = dataclasses.replace(cohort.COHORT, participants=4, scale=16)
    counts = synth.generate(tmp_path, cfg, workers=0)
    table = pd.read_csv(tmp_path / synth.LESION_TABLE, sep="\t", dtype={"participant_id": str})
    files = set(pd.read_csv(tmp_path / "retinal_oct" / "manifest.tsv", sep="\t")["filepath"])
    assert len(table) == counts["lesions"] > 0 and set(table["filepath"]) <= files
    assert set(table["kind"]) <= {"focus", "cyst"} and table["z"].between(0.2, 0.8).all()

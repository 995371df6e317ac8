"""The learning check's probe subsets: label fractions stratified, nested and shared; scanner
folds that never test a person the probe trained on."""
import numpy as np
import pytest

from evals import subsets


def rows(n_people=80, devices=("a", "b", "c", "d")):
    out = []
    for i in range(n_people):
        split = ("train", "train", "train", "val", "test")[i % 5]
        for eye in ("l", "r"):
            out.append({"participant_id": f"p{i:03d}", "label": i % 4, "split": split, "device": devices[i % len(devices)],
                        "relpath": f"{i}/{eye}"})
    return out


def test_fractions_are_stratified_nested_and_seeded():
    r = rows()
    sub = subsets.nested_fractions(r, [0.1, 0.25, 1.0], seed=0)
    people = subsets.participant_labels(r)
    assert sub[1.0] == set(people) and sub[0.1] < sub[0.25] < sub[1.0]
    for f, chosen in sub.items():                        # each label in proportion (12 train people per label)
        counts = np.bincount([people[p] for p in chosen], minlength=4)
        assert (counts == max(1, round(f * 12))).all(), (f, counts)
    assert subsets.nested_fractions(r, [0.1], seed=0)[0.1] == sub[0.1]       # the same for every caller
    assert subsets.nested_fractions(r, [0.1], seed=1)[0.1] != sub[0.1]
    mask = subsets.train_mask(r, sub[0.1])
    assert mask.sum() == 2 * len(sub[0.1]) and all(r[i]["split"] == "train" for i in np.flatnonzero(mask))
    with pytest.raises(ValueError, match="not in"):
        subsets.nested_fractions(r, [0.0], seed=0)


def test_scanner_folds_hold_each_device_out():
    r = rows()
    folds = subsets.scanner_folds(r)
    assert [d for d, *_ in folds] == ["a", "b", "c", "d"]
    tested = np.zeros(len(r), bool)
    for d, tr, va, te in folds:
        assert not any(r[i]["device"] == d for i in np.flatnonzero(tr | va))
        assert all(r[i]["device"] == d and r[i]["split"] == "test" for i in np.flatnonzero(te))
        assert not tested[te].any()
        tested |= te
    assert tested.sum() == sum(x["split"] == "test" for x in r)          # every test row scored once

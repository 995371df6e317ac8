"""A participant whose volumes sit in two splits is a leak whatever the devices: a Spectralis volume
in train and a Triton one in test still put one person on both sides. The leak is
planted across devices only, each (participant, device) within one split, so a check grouping by
(participant, device) misses it."""
from __future__ import annotations

import pandas as pd
import pytest

from evals import probe
from manifests.splits import split_leaks
from octfm.cli import UsageError


def test_split_leaks_finds_a_participant_split_across_devices():
    rows = pd.DataFrame({
        "participant_id": ["1001", "1001", "1001", "1002", "1002"],
        "device": ["Spectralis", "Spectralis", "Triton", "Spectralis", "Triton"],
        "split": ["train", "train", "test", "val", "val"],
    })
    assert rows.groupby(["participant_id", "device"])["split"].nunique().max() == 1  # no leak within a device
    assert split_leaks(rows) == ["1001"]


def _cross_device_leak(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The manifest with one participant's volumes on two devices in two splits: a second participant's
    volumes (another device) given the first one's ID, in another split than the first one's."""
    ok = df[(df.status == "ok") & df.label.notna() & df.split.isin(probe.PROBED_SPLITS)]
    who, device, split = ok.iloc[0][["participant_id", "device", "split"]]
    other = ok[(ok.device != device) & (ok.participant_id != who)].participant_id.iloc[0]
    df = df.copy()
    moved = df.participant_id == other
    df.loc[moved, "participant_id"] = who
    df.loc[moved, "split"] = "test" if split != "test" else "train"
    return df, who


def test_the_probes_refuse_a_cache_whose_participant_is_split_across_devices(tiny_cache, tmp_path):
    df, who = _cross_device_leak(pd.read_parquet(tiny_cache / "manifest.parquet"))
    mine = df[df.participant_id == who]
    assert mine.split.nunique() == 2 and mine.groupby("device").split.nunique().max() == 1
    (tmp_path / "manifest.parquet").mkdir()
    df.to_parquet(tmp_path / "manifest.parquet" / "part-0000-of-0001.parquet")
    with pytest.raises(UsageError, match=rf"more than one split: \['{who}'\]"):
        probe.labelled_rows(str(tmp_path), 0, False)

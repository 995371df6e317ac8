"""Participant-level splits: no participant in two splits, whatever the eye or device."""
from __future__ import annotations

import numpy as np
import pandas as pd

from manifests.aireadi import SPLITS

DEFAULT_FRACTIONS = (0.70, 0.15, 0.15)


def stratified_split(participants: pd.DataFrame, seed: int = 0,
                     fractions: tuple[float, float, float] = DEFAULT_FRACTIONS) -> pd.Series:
    """Assign train/val/test per participant, stratified by label (null labels form a stratum).

    Deterministic for a seed and the set of participant IDs (sorted before shuffling), so
    the row order of the table does not matter.
    """
    rng = np.random.default_rng(seed)
    out = pd.Series(index=participants.index, dtype=object)
    strata = participants["label"].astype("object").where(participants["label"].notna(), "none")
    for key in sorted(strata.unique(), key=str):
        idx = participants.index[strata == key]
        ids = participants.loc[idx, "participant_id"]
        order = idx[np.argsort(ids.to_numpy(), kind="stable")]
        order = order[rng.permutation(len(order))]
        n = len(order)
        n_train = int(round(fractions[0] * n))
        n_val = int(round(fractions[1] * n))
        if n >= 3:  # keep every split non-empty where the stratum allows it
            n_val = max(n_val, 1)
            n_train = min(n_train, n - n_val - 1)
        for i, pos in enumerate(order):
            out[pos] = SPLITS[0] if i < n_train else SPLITS[1] if i < n_train + n_val else SPLITS[2]
    return out


def fill_splits(participants: pd.DataFrame, seed: int = 0) -> tuple[pd.DataFrame, int]:
    """Keep recommended splits; give the participants without one a seeded stratified split."""
    df = participants.copy()
    missing = df["split"].isna()
    if missing.any():
        df.loc[missing, "split"] = stratified_split(df[missing], seed=seed)
    return df, int(missing.sum())


def split_leaks(rows: pd.DataFrame) -> list[str]:
    """Participant IDs that appear in more than one split (should be empty)."""
    per = rows.dropna(subset=["split"]).groupby("participant_id")["split"].nunique()
    return sorted(per[per > 1].index)

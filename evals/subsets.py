"""Which labelled rows train a probe in the learning check's two harder questions.

- Label efficiency: a fraction of the training participants (10%, 25%, ...), stratified by
  label and nested (each smaller subset inside the larger ones), drawn once from a seed, so every
  encoder and the supervised reference see the same participants at each fraction.
- Across scanners: probes trained on three scanners' rows and tested on the fourth's, each in
  turn; every test row is scored by the fold that held its scanner out.
Participants, not volumes, are the unit: both eyes (and every device) of one person go together.
"""
from __future__ import annotations

import numpy as np


def participant_labels(rows: list[dict], split: str = "train") -> dict[str, int]:
    """One label per participant of `split` (rows of one participant share it)."""
    return {r["participant_id"]: r["label"] for r in rows if r["split"] == split}


def nested_fractions(rows: list[dict], fractions, seed: int) -> dict[float, set[str]]:
    """{fraction: participants}: for each label, its train participants in one seeded order; a
    fraction takes the first round(fraction x n) of each label's list (at least one), so the
    subsets are stratified and nested, and the same for every encoder."""
    people = participant_labels(rows)
    rng = np.random.default_rng(seed)
    order: dict = {}
    for label in sorted({v for v in people.values()}, key=str):
        ids = sorted(p for p, v in people.items() if v == label)
        order[label] = [ids[i] for i in rng.permutation(len(ids))]
    out = {}
    for f in sorted(fractions):
        if not 0 < f <= 1:
            raise ValueError(f"label fraction {f} is not in (0, 1]")
        out[f] = {p for ids in order.values() for p in ids[:max(1, round(f * len(ids)))]}
    return out


def train_mask(rows: list[dict], participants: set[str]) -> np.ndarray:
    """Train-split rows of these participants."""
    return np.array([r["split"] == "train" and r["participant_id"] in participants for r in rows])


def scanner_folds(rows: list[dict]) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """[(held-out scanner, train mask, val mask, test mask)]: train and select on the other scanners'
    train and val rows, test on the held-out scanner's test rows. Splits are by participant, so no
    test person trains a probe, even one scanned on several scanners (only their held-out
    device's volumes are scored in that fold)."""
    scanners = np.array([r["device"] for r in rows])
    split = np.array([r["split"] for r in rows])
    return [(d, (split == "train") & (scanners != d), (split == "val") & (scanners != d), (split == "test") & (scanners == d))
            for d in sorted(set(scanners))]

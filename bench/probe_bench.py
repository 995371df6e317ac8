"""The learning check's probe fits: several encoders' heads trained as one stack (check_probes.fit_encoders)
against one encoder at a time (fit_encoder each), on features of the CPU check's shape (1,500 rows,
72 grid-pooled tokens of 96 channels: the pretrained encoder and three random-init draws), the
probes' grid and both head kinds, one fold. Rounds alternate the order; the ratio is the median of
the rounds'. The probabilities of the two ways are compared too: the stack must give each encoder
what it gets alone (float rounding apart)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from check import probes as check_probes
from evals.config import ProbeConfig

ENCODERS, ROWS, TOKENS, DIM = 4, 1500, 72, 96


def features(rows: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Encoders' features with a weak label signal, and rows split 70/15/15 by participant (two eyes each)."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 4, rows // 2).repeat(2)
    feats = []
    for e in range(ENCODERS):
        t = rng.standard_normal((rows, TOKENS, DIM)).astype(np.float32)
        t[:, : 4, e] += 0.5 * label[:, None]
        feats.append({"pooled": t.max(1), "tokens": t.astype(np.float16)})
    split = np.array(["train"] * 7 + ["val"] * 3 + ["test"] * 3 + ["train"] * 7)[np.arange(rows // 2) % 20].repeat(2)
    meta = [{"label": int(label[i]), "split": str(split[i]), "participant_id": f"p{i // 2}"} for i in range(rows)]
    return feats, meta


def run(workdir: Path, quick: bool = False):
    rows, rounds = (300, 1) if quick else (ROWS, 3)
    feats, meta = features(rows)
    cfg = ProbeConfig(epochs=5 if quick else 20, bootstrap=200)
    fs = check_probes.folds(meta, "splits")
    times: dict[str, list[float]] = {"stack": [], "each": []}
    out = {}
    for r in range(rounds):
        for way in (("stack", "each") if r % 2 == 0 else ("each", "stack")):
            t = time.perf_counter()
            out[way] = (check_probes.fit_encoders(cfg, feats, "diabetic", meta, fs) if way == "stack" else
                        [check_probes.fit_encoder(cfg, f, "diabetic", meta, fs) for f in feats])
            times[way].append(time.perf_counter() - t)
    gap = max(float(np.abs(a[k]["prob"] - b[k]["prob"]).max()) for a, b in zip(out["stack"], out["each"]) for k in cfg.heads)
    ratio = statistics.median(e / s for e, s in zip(times["each"], times["stack"]))
    res = {"stack_s": [round(t, 2) for t in times["stack"]], "each_s": [round(t, 2) for t in times["each"]],
           "speedup": round(ratio, 2), "max_probability_gap": gap, "rounds": rounds, "epochs": cfg.epochs,
           "rows": rows, "encoders": ENCODERS}
    same = gap < 1e-4
    lines = [f"## Probe fits: {ENCODERS} encoders' heads as one stack vs one encoder at a time (CPU, {rows} rows, "
             f"{TOKENS} tokens x {DIM}, {cfg.epochs} epochs, linear + attentive grids)", "",
             "| way | wall s, per round |", "|---|---|", f"| one stack | {res['stack_s']} |",
             f"| one encoder at a time | {res['each_s']} |", "",
             f"Verdict: {'met' if ratio > 1.2 and same else 'NOT MET'}: the stack {ratio:.2f}x as fast (median of "
             f"{rounds} alternating rounds; the bar: faster by a fifth), each encoder's test probabilities within "
             f"{gap:.1e} of its own fit (the bar: 1e-4)."]
    return res, lines

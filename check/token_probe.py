"""Is the lesion in the tokens? A token-level probe on a generated lesions cohort.

A pooled readout can miss a few lesion tokens among hundreds for two reasons: the tokens do not
hold the lesion, or the pooling drowns it. This measures the first. The cohort's answer key
(`lesions.tsv`, written by ingest/synth.py) says where every lesion sits; mapped onto the
encoder's token grid over the probes' centre crop, a token is a lesion token (a lesion centre
inside it), a background token (no lesion within LESION_EDGE of it) or left out (a lesion's edge
only). A logistic regression on one token's features, trained on the train split's tokens with
its L2 chosen on val, scores the test tokens. The score is the AUROC *within token position*
(each lesion token against background tokens at the same grid position, pooled over positions),
so neither the position embedding nor the anatomy a position sees can carry it. Scored alike:
the checkpoint's EMA target encoder, a random-init encoder of the same architecture, and the
token's own voxels (mean, spread and extremes of its tubelet): what a detector with no encoder
reads. Intervals: bootstrap over test participants, paired between encoders.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from evals import features, probe
from evals import probe_metrics as pm
from ingest import synth
from octfm import cli, fsio
from train import checkpoint, data, encoder
from train.run_folder import RunFolder

L2_GRID = (1e-4, 1e-3, 1e-2)
LESION, BACKGROUND, LEFT_OUT = 1, 0, -1


def read_lesions(source: str | Path) -> dict[str, pd.DataFrame]:
    """The cohort's lesion table by volume (the cache row's `relpath`: the source path without its
    leading slash)."""
    path = Path(source) / synth.LESION_TABLE
    if not path.exists():
        raise cli.UsageError(f"{path}: no lesion table (a cohort from `python -m ingest.synth --lesions ...` has one)")
    table = pd.read_csv(path, sep="\t", dtype={"participant_id": str})
    return {k.lstrip("/"): g for k, g in table.groupby("filepath")}


def token_labels(lesions: pd.DataFrame | None, cache_shape, crop, tubelet) -> np.ndarray:
    """[N] int8 in the encoder's token order (the grid row-major): LESION where a lesion centre
    falls inside the token, LEFT_OUT where only a lesion's edge reaches it (ellipsoid distance
    below LESION_EDGE from its box), BACKGROUND elsewhere. Lesion coordinates are fractions of the
    volume's extent (synth.lesion_table), which a cache resized over the whole extent keeps."""
    grid = [c // t for c, t in zip(crop, tubelet)]
    out = np.full(grid, BACKGROUND, dtype=np.int8)
    if lesions is None or not len(lesions):
        return out.ravel()
    offset = [(s - c) // 2 for s, c in zip(cache_shape, crop)]
    lo = [np.arange(g) * t for g, t in zip(grid, tubelet)]           # token boxes per axis, crop voxels
    hits = []
    for les in lesions.itertuples():
        centre = [(les.y + 1) / 2 * cache_shape[0], les.z * cache_shape[1], (les.x + 1) / 2 * cache_shape[2]]
        radius = [les.radius_y / 2 * cache_shape[0], les.radius_z * cache_shape[1], les.radius_x / 2 * cache_shape[2]]
        p = [c - o for c, o in zip(centre, offset)]
        gap = [np.maximum(0.0, np.maximum(lo_a - pa, pa - (lo_a + t))) / r for lo_a, pa, t, r in zip(lo, p, tubelet, radius)]
        d2 = gap[0][:, None, None] ** 2 + gap[1][None, :, None] ** 2 + gap[2][None, None, :] ** 2
        out[d2 < synth.LESION_EDGE] = LEFT_OUT
        idx = [int(np.floor(pa / t)) for pa, t in zip(p, tubelet)]
        if all(0 <= i < g for i, g in zip(idx, grid)):
            hits.append(tuple(idx))
    for idx in hits:  # after every edge, so a centre is never overwritten by a neighbour's edge
        out[idx] = LESION
    return out.ravel()


def voxel_stats(cache: str, rows: list[dict], stride, crop, tubelet, batch: int = 8) -> np.ndarray:
    """[n, N, 6] per token of each volume's centre crop: mean, std, min, max, 5th and 95th
    percentile of its voxels (0-1): the no-encoder baseline."""
    out = []
    for x, _ in encoder.volume_batches(cache, rows, stride, crop, batch):
        t = _tubelets(x[:, 0].float() / 255.0, tubelet)                               # [b, N, voxels]
        q = torch.quantile(t, torch.tensor([0.05, 0.95]), dim=-1).permute(1, 2, 0)    # [b, N, 2]
        out.append(torch.cat([t.mean(-1, keepdim=True), t.std(-1, keepdim=True), t.amin(-1, keepdim=True),
                              t.amax(-1, keepdim=True), q], -1).numpy())
    return np.concatenate(out).astype(np.float32)


def _tubelets(x: torch.Tensor, tubelet) -> torch.Tensor:
    """[b, D, H, W] -> [b, N, voxels per tubelet], tokens in the grid's (patchify's) order."""
    b, d, h, w = x.shape
    kd, kh, kw = tubelet
    return x.reshape(b, d // kd, kd, h // kh, kh, w // kw, kw).permute(0, 1, 3, 5, 2, 4, 6).reshape(b, -1, kd * kh * kw)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, steps: int = 60) -> tuple[np.ndarray, float]:
    """Class-balanced logistic regression by L-BFGS on standardised features: (w, b)."""
    X, Y = torch.from_numpy(x).float(), torch.from_numpy(y).float()
    pos = Y.mean().clamp(1e-6, 1 - 1e-6)
    weight = torch.where(Y > 0, 0.5 / pos, 0.5 / (1 - pos))
    w = torch.zeros(X.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(X @ w + b, Y, weight=weight) +
                l2 * (w ** 2).sum())
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy(), float(b.detach())


def within_position_auroc(score: np.ndarray, label: np.ndarray, position: np.ndarray,
                          weights: np.ndarray | None = None) -> np.ndarray:
    """AUROC of lesion tokens against background tokens at the same position, pooled over
    positions: the weighted share of (lesion, background) pairs at one position that the score
    orders right. `weights` [B, n] (bootstrap resamples) or None; returns [B] (or [1])."""
    keep = label >= 0
    score, label, position = score[keep], label[keep], position[keep]
    w = np.ones((1, len(score))) if weights is None else np.atleast_2d(weights)[:, keep]
    order = np.lexsort((score, position))
    y, p, w = label[order], position[order], w[:, order]
    pos_w, neg_w = w * (y == LESION), w * (y == BACKGROUND)
    starts = np.r_[0, np.flatnonzero(np.diff(p)) + 1]
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(p)]))
    below = np.cumsum(neg_w, axis=1) - neg_w                      # background weight ranked below, globally
    below -= below[:, starts][:, group] if len(starts) else 0     # ... within the position
    num = (pos_w * below).sum(1)
    den = (np.add.reduceat(pos_w, starts, axis=1) * np.add.reduceat(neg_w, starts, axis=1)).sum(1)
    return num / np.maximum(den, 1e-12)


def standardise(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    mu, sd = train.mean(0), train.std(0) + 1e-6
    return [(a - mu) / sd for a in (train, *others)]


def score_encoder(feats: np.ndarray, labels: np.ndarray, split: np.ndarray) -> dict:
    """feats [n, N, d], labels [n, N], split [n]: the logistic probe with its L2 chosen on val's
    within-position AUROC; the test tokens' scores."""
    n_tok = feats.shape[1]
    flat = lambda a: a.reshape(-1, a.shape[-1]) if a.ndim == 3 else a.reshape(-1)  # noqa: E731
    pos = np.tile(np.arange(n_tok), len(feats))
    tok_split = np.repeat(split, n_tok)
    X, Y = flat(feats).astype(np.float32), flat(labels)
    tr = (tok_split == "train") & (Y >= 0)
    Xtr, Xall = standardise(X[tr], X)
    best = None
    for l2 in L2_GRID:
        w, b = fit_logistic(Xtr, Y[tr], l2)
        s = Xall @ w + b
        va = tok_split == "val"
        auc = float(within_position_auroc(s[va], Y[va], pos[va])[0])
        if best is None or auc > best["val_auroc"]:
            best = {"l2": l2, "val_auroc": auc, "score": s}
    return best


def bootstrap_weights(participants: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n] per-row weights: how often each row is drawn in the check's participant
    resamples (probe_metrics.participant_resamples), so a weighted score is the resample's score."""
    return np.stack([np.bincount(idx, minlength=len(participants))
                     for idx in pm.participant_resamples(participants, n_boot, seed)]).astype(np.float32)


def compare_scorers(scores: dict, labels: np.ndarray, split: np.ndarray, participants: np.ndarray, n_boot: int,
            seed: int) -> dict:
    """Test within-position AUROC of each scorer with its interval, and pretrained minus each other
    scorer, paired over the same resamples."""
    n_tok = labels.shape[1]
    te = np.repeat(split == "test", n_tok)
    pos = np.tile(np.arange(n_tok), len(labels))[te]
    y = labels.reshape(-1)[te]
    w = bootstrap_weights(np.repeat(participants, n_tok)[te], n_boot, seed)
    point, boots = {}, {}
    for name, s in scores.items():
        st = s["score"][te]
        point[name] = float(within_position_auroc(st, y, pos)[0])
        boots[name] = np.concatenate([within_position_auroc(st, y, pos, w[i:i + 25]) for i in range(0, n_boot, 25)])
    out = {"test_lesion_tokens": int((y == LESION).sum()), "test_background_tokens": int((y == BACKGROUND).sum()),
           "scorers": {n: {"test_auroc": point[n], "ci95": pm.ci95(boots[n]), "val_auroc": scores[n]["val_auroc"],
                           "l2": scores[n]["l2"]} for n in scores}}
    for other in (n for n in scores if n != "pretrained"):
        out[f"pretrained_minus_{other}"] = {"difference": point["pretrained"] - point[other],
                                            "difference_ci95": pm.ci95(boots["pretrained"] - boots[other])}
    return out


def run(ckpt: str, source: str, out: Path, cache: str | None = None, seed: int = 0, n_boot: int = 200,
        device: str = "cpu", batch: int = 8, features_dir: Path | None = None, precision: str = "fp32",
        random_seed: int | None = None) -> dict:
    """The token probe of one checkpoint on a generated lesions cohort; writes <out>/token_probe.json
    and .md. Token features are kept under `features_dir` (<out>/features; a re-run reuses them;
    the learning check points it at its probes' features, whose pass wrote them: probe.encoder_features),
    computed under `precision` autocast (features.resolve_precision). `random_seed`: the random-init
    encoder's init seed (None: seed + 1, the probes' first draw by default; the check passes its draw 1's)."""
    enc, tcfg, ident = features.checkpoint_encoder(ckpt)
    cache = cache or tcfg.data.cache
    rows = probe.labelled_rows(cache, seed, False)
    key = read_lesions(source)
    crop, tubelet = tcfg.data.input_shape, tcfg.model.tubelet
    full = data.strided_shape(rows[0]["shape"], tcfg.data.stride)
    labels = np.stack([token_labels(key.get(r["relpath"]), full, crop, tubelet) for r in rows])
    split = np.array([r["split"] for r in rows])
    participants = np.array([r["participant_id"] for r in rows])
    r_enc, _, r_ident = features.checkpoint_encoder(None, seed=seed + 1 if random_seed is None else random_seed,
                                                    train_cfg=tcfg)
    scores, encs = {}, {"pretrained": (enc, ident), "random_init": (r_enc, r_ident)}
    precision = features.resolve_precision(precision, device)
    keys = {name: features.grid_key(idn, rows, tcfg, precision) for name, (_, idn) in encs.items()}
    feats, reused = features.cached_all(features_dir or out / "features", keys, lambda names, part: features.extract_all(
        {n: encs[n][0] for n in names}, tcfg, rows[part], cache, features.FULL_GRID, device, batch,
        precision=precision), len(rows))  # one pass
    for name, f in feats.items():
        scores[name] = score_encoder(f["tokens"], labels, split)
        print(f"token-probe: {name} val within-position AUROC {scores[name]['val_auroc']:.3f}", flush=True)
    raw = voxel_stats(cache, rows, tcfg.data.stride, crop, tubelet, batch)
    scores["voxels"] = score_encoder(raw, labels, split)
    result = {"ckpt": ckpt, "source": source, "cache": cache, "step": ident["step"], "tokens_per_volume": labels.shape[1],
              "lesion_tokens_per_volume": float((labels == LESION).sum(1).mean()), "features_reused": reused,
              **compare_scorers(scores, labels, split, participants, n_boot, seed), "bootstrap": n_boot}
    out.mkdir(parents=True, exist_ok=True)
    fsio.atomic_write_bytes(str(out / "token_probe.json"), json.dumps(result, indent=2).encode())
    fsio.atomic_write_bytes(str(out / "token_probe.md"), markdown(result).encode())
    return result


def markdown(r: dict) -> str:
    lines = ["# Token probe: is the lesion in the tokens?", "",
             f"Checkpoint `{r['ckpt']}` (step {r['step']}); {r['tokens_per_volume']} tokens per volume, "
             f"{r['lesion_tokens_per_volume']:.1f} lesion tokens per volume on average; test: "
             f"{r['test_lesion_tokens']} lesion and {r['test_background_tokens']} background tokens. Score: AUROC of "
             f"lesion against background tokens at the same grid position, 95% bootstrap over test participants "
             f"({r['bootstrap']} resamples).", "",
             "| scorer | val AUROC | test AUROC [95% CI] | L2 |", "|---|---|---|---|"]
    for name, s in r["scorers"].items():
        lines.append(f"| {name} | {s['val_auroc']:.3f} | {s['test_auroc']:.3f} [{s['ci95'][0]:.3f}, "
                     f"{s['ci95'][1]:.3f}] | {s['l2']:g} |")
    lines.append("")
    for k, d in r.items():
        if k.startswith("pretrained_minus_"):
            lines.append(f"- {k.replace('_', ' ')}: {d['difference']:+.3f} [{d['difference_ci95'][0]:+.3f}, "
                         f"{d['difference_ci95'][1]:+.3f}]")
    return "\n".join(lines) + "\n"


def line(r: dict) -> str:
    s = r["scorers"]
    d = r["pretrained_minus_random_init"]
    return (f"token probe (test AUROC within position): pretrained {s['pretrained']['test_auroc']:.3f}, random-init "
            f"{s['random_init']['test_auroc']:.3f}, voxels {s['voxels']['test_auroc']:.3f}; pretrained - random-init "
            f"{d['difference']:+.3f} [{d['difference_ci95'][0]:+.3f}, {d['difference_ci95'][1]:+.3f}]")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m check.token_probe", description=__doc__)
    ap.add_argument("--run", required=True, help="a pretraining run folder (its newest whole checkpoint)")
    ap.add_argument("--source", required=True, help="the generated cohort's root (holds lesions.tsv)")
    ap.add_argument("--cache", default=None, help="default: the cache the run trained on")
    ap.add_argument("--out", default=None, help="default: <run>/probe/tokens")
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-seed", type=int, default=None,
                    help="the random-init encoder's init seed (default 1, the probes' first draw); a learning check's "
                         "run: its result.json's random_init_seeds[0] (each generated cohort's own)")
    a = ap.parse_args(argv)
    folder = RunFolder(a.run)
    ckpt = checkpoint.newest_whole(folder.checkpoints())
    r = run(ckpt, a.source, Path(a.out) if a.out else folder.probe / "tokens", a.cache, n_boot=a.bootstrap,
            device=a.device, random_seed=a.random_seed)
    print(markdown(r))
    print(line(r))
    return 0


if __name__ == "__main__":
    cli.run(main)

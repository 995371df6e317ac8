"""Frozen-encoder features, extracted once per (checkpoint, cache, extraction settings) and
kept on disk, so probes train from them in seconds and re-runs reuse them."""
from __future__ import annotations

import io
import shutil
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

from octfm import config, fsio
from train import checkpoint, encoder, runtime
from train.config import TrainConfig, saved_config
from train.model import Encoder

# What makes the features (the encoder's forward and pooling, the crops it reads): with their inputs it keys them,
# so features made by older code (before the bf16 residual stream, say) are made afresh, not reused; embeddings
# (evals/embed.py) are keyed on it too
FEATURE_CODE = ("evals/features.py",)


def feature_code_key() -> str:
    """The content key of FEATURE_CODE's import closure (config.code_key, as the learning check keys its runs)."""
    return config.code_key(FEATURE_CODE)


def checkpoint_encoder(ckpt: str | None, seed: int = 0, train_cfg: TrainConfig | None = None,
                       state: dict | None = None) -> tuple[Encoder, TrainConfig, dict]:
    """The EMA target encoder of a checkpoint (V-JEPA evaluates it), or a random one of the
    same architecture when ckpt is None (the baseline). Returns encoder, config, identity.
    `state`: the checkpoint already loaded (a caller that reads more of it loads it once), from
    `ckpt` as checkpoint.load_named resolved it. latest.pt is resolved once: the weights and the
    identity are of one file, even when a save lands meanwhile."""
    if ckpt:
        ckpt, st = (ckpt, state) if state is not None else checkpoint.load_named(ckpt)
        cfg = saved_config(st["config"], ckpt)
        enc = Encoder(cfg.model, cfg.data.input_shape)
        enc.load_state_dict(st["target"])
        # checkpoint.identity (name, size, time), not the path as spelled: one key however CKPT is written
        ident = {"step": int(st["step"]), **checkpoint.identity(ckpt)}
    else:
        cfg = train_cfg
        torch.manual_seed(seed)
        enc = Encoder(cfg.model, cfg.data.input_shape)
        ident = {"ckpt": None, "random_seed": seed, "model": config.to_dict(cfg.model)}  # the seed alone names no architecture
    return enc.eval(), cfg, ident


PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str, device) -> str:
    """"auto": bf16 autocast on CUDA (as training runs there), float32 elsewhere."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return precision


def autocast(precision: str, device):
    """The no-grad passes' autocast, the one training uses (runtime.Runtime.autocast)."""
    dev = torch.device(device)
    return runtime.Runtime(dev.type, dev, bf16=precision == "bf16").autocast()


@torch.no_grad()
def extract(enc: Encoder, cfg: TrainConfig, rows: list[dict], cache: str, token_pool, device="cpu", batch: int = 4,
            progress=None, precision: str = "fp32", tokens: bool = True, token_dtype=torch.float16,
            pad: bool = False) -> dict:
    """Pooled features [n, d] (float32) and grid-pooled tokens [n, N', d] (`token_dtype`; none without
    `tokens`), both pooled as the encoder's `model.pool` says; `precision` "bf16" runs the encoder under
    bf16 autocast; `pad` fills the last batch to `batch` rows (one compiled shape on XLA)."""
    return extract_all({"": enc}, cfg, rows, cache, token_pool, device=device, batch=batch, progress=progress,
                       precision=precision, tokens=tokens, token_dtype=token_dtype, pad=pad)[""]


@torch.no_grad()
def extract_all(encs: dict[str, Encoder], cfg: TrainConfig, rows: list[dict], cache: str, token_pool, device="cpu",
                batch: int = 4, progress=None, precision: str = "fp32", tokens: bool = True,
                token_dtype=torch.float16, pad: bool = False, batches=None) -> dict[str, dict]:
    """`extract` for several encoders of one input shape in one pass over the cache: each batch is
    read once and run through every encoder (the learning check's random-init draws: reading the
    volumes is a large share of an encoder's pass on a GPU). Each encoder's features are the ones
    `extract` gives it alone. `token_pool` one grid pooling for all, or {name: pooling}: names
    that share one Encoder object run it once a batch and pool its tokens each their own way (the
    check's headline features and the token probe's full grid). `batches`: the uint8 batches and their
    real row counts to run instead of reading `rows` (fine-tuning's kept val crops). The one loop from
    cached volumes to features: probes, embeddings, the check and fine-tuning's scores all run it.
    Returns {name: features}."""
    pools = token_pool if isinstance(token_pool, dict) else {name: token_pool for name in encs}
    encs = {name: e.to(device) for name, e in encs.items()}
    pooled, grids = {name: [] for name in encs}, {name: [] for name in encs}
    if batches is None:
        batches = encoder.volume_batches(cache, rows, cfg.data.stride, cfg.data.input_shape, batch, pad=pad)
    for x, n in batches:
        x = x.to(device)
        ran = {}  # id(encoder) -> its tokens of this batch
        for name, enc in encs.items():
            if id(enc) not in ran:
                with autocast(precision, device):
                    ran[id(enc)] = encoder.tokens(enc, x).float()                     # [b, N, d]
            h = ran[id(enc)]
            pooled[name].append(enc.pool(h)[:n].cpu())
            if tokens:
                grids[name].append(enc.pool_grid(h, pools[name])[:n].to(token_dtype).cpu())
        if progress:
            progress(n)
    return {name: {"pooled": torch.cat(pooled[name]).numpy(), "tokens": torch.cat(grids[name]).numpy() if tokens else None}
            for name in encs}


FULL_GRID = (1, 1, 1)  # no pooling: one feature vector per token (the token probe's features)


def feature_key(ident: dict, rows: list[dict], cfg: TrainConfig, token_pool, precision: str = "fp32") -> str:
    blob = {"encoder": ident, "rows": [(r["relpath"], r["cache_key"]) for r in rows], "stride": list(cfg.data.stride),
            "input": list(cfg.data.input_shape), "pool": list(token_pool), "code": feature_code_key()}
    if precision != "fp32":  # float32 features keep the keys they had before precision was a setting
        blob["precision"] = precision
    return config.content_key(blob, 20)


def grid_key(ident: dict, rows: list[dict], cfg: TrainConfig, precision: str = "fp32") -> str:
    """The key of an encoder's full token grid (FULL_GRID) on those rows: the token probe reads it,
    and the learning check's features pass writes it beside the probes' features."""
    return "tokens_" + feature_key(ident, rows, cfg, FULL_GRID, precision)


PART_ROWS = 512  # rows a pass computes and writes before the next: what a killed pass loses at most


def cached_all(out_dir: Path, keys: dict[str, str], compute, n_rows: int,
               write_only: Collection[str] = ()) -> tuple[dict, dict]:
    """Load <out_dir>/<key>.npz of each named key, and compute the missing ones together,
    PART_ROWS rows at a time (`compute(names, part)` -> {name: arrays of rows[part]}, one pass over
    those rows: extract_all). Each part is written as soon as it is computed (<key>.parts/), so a
    pass killed midway resumes from the rows done; when all are, the parts become <key>.npz,
    written atomically. `write_only`: names made on disk but neither loaded nor returned (the
    token probe's full grids, read later by another stage: about 1 GB at GPU size), each held in
    memory only while its file is written. Returns ({name: arrays}, {name: reused})."""
    out_dir = Path(out_dir)
    paths = {name: out_dir / f"{key}.npz" for name, key in keys.items()}
    feats, reused = {}, {name: path.exists() for name, path in paths.items()}
    for name, path in paths.items():
        if reused[name] and name not in write_only:
            feats[name] = _load(path)
    missing = [name for name in keys if not reused[name]]
    parts = {name: out_dir / f"{keys[name]}.parts" for name in missing}
    done = {name: [] for name in missing}
    for lo in range(0, n_rows, PART_ROWS):
        part = slice(lo, min(lo + PART_ROWS, n_rows))
        files = {name: parts[name] / f"{part.start:09d}-{part.stop:09d}.npz" for name in missing}
        todo = [name for name in missing if not files[name].exists()]
        computed = compute(todo, part) if todo else {}
        for name in missing:
            if name in computed:
                _save(files[name], computed[name])
            # a write-only name's parts stay on disk until its whole file is made
            done[name].append(files[name] if name in write_only else
                              computed[name] if name in computed else _load(files[name]))
        del computed
    for name in missing:
        chunks = [_load(d) if isinstance(d, Path) else d for d in done.pop(name)]
        whole = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
        del chunks
        _save(paths[name], whole)
        shutil.rmtree(parts[name], ignore_errors=True)
        if name not in write_only:
            feats[name] = whole
    return {name: feats[name] for name in keys if name not in write_only}, reused


def _load(path: Path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _save(path: Path, arrays: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    fsio.atomic_write_bytes(str(path), buf.getvalue())

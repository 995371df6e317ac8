"""Frozen-encoder features, extracted once per (checkpoint, cache, extraction settings) and
kept on disk, so probes train from them in seconds and re-runs reuse them."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from octfm import config, fsio
from train import checkpoint, encoder, runtime
from train.config import TrainConfig
from train.model import Encoder

FEATURE_VERSION = "1"


def checkpoint_encoder(ckpt: str | None, seed: int = 0, train_cfg: TrainConfig | None = None,
                       state: dict | None = None) -> tuple[Encoder, TrainConfig, dict]:
    """The EMA target encoder of a checkpoint (V-JEPA evaluates it), or a random one of the
    same architecture when ckpt is None (the baseline). Returns encoder, config, identity.
    `state`: the checkpoint already loaded (a caller that reads more of it loads it once)."""
    if ckpt:
        st = state if state is not None else checkpoint.load(ckpt)
        cfg = config.from_dict(TrainConfig, st["config"], where=f"{ckpt} (config)")
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
    enc = enc.to(device)
    pooled, grids = [], []
    for x, n in encoder.volume_batches(cache, rows, cfg.data.stride, cfg.data.input_shape, batch, pad=pad):
        with autocast(precision, device):
            h = encoder.tokens(enc, x.to(device)).float()                             # [b, N, d]
        pooled.append(enc.pool(h)[:n].cpu())
        if tokens:
            grids.append(enc.pool_grid(h, token_pool)[:n].to(token_dtype).cpu())
        if progress:
            progress(n)
    return {"pooled": torch.cat(pooled).numpy(), "tokens": torch.cat(grids).numpy() if tokens else None}


def feature_key(ident: dict, rows: list[dict], cfg: TrainConfig, token_pool, precision: str = "fp32") -> str:
    blob = {"encoder": ident, "rows": [(r["relpath"], r["cache_key"]) for r in rows], "stride": list(cfg.data.stride),
            "input": list(cfg.data.input_shape), "pool": list(token_pool), "version": FEATURE_VERSION}
    if precision != "fp32":  # float32 features keep the keys they had before precision was a setting
        blob["precision"] = precision
    return config.content_key(blob, 20)


def cached(out_dir: Path, key: str, compute) -> tuple[dict, bool]:
    """Load <out_dir>/<key>.npz, or compute and write it atomically. Returns (arrays, reused)."""
    path = Path(out_dir) / f"{key}.npz"
    if path.exists():
        with np.load(path) as z:
            return {k: z[k] for k in z.files}, True
    arrays = compute()
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    fsio.atomic_write_bytes(str(path), buf.getvalue())
    return arrays, False

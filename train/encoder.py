"""The public encoder API: load a model folder written by `make export` and embed cached volumes.

    from train.encoder import load_encoder
    enc = load_encoder("models/vjepa_b")   # a torch.nn.Module in eval mode
    out = enc(volumes)                     # uint8 [B, D, H, W] as the cache stores them
    out.pooled                             # [B, dim]: the tokens pooled as `pool` says (the probes' feature)
    out.tokens                             # [B, N, dim]: one per tubelet of the token grid

A model folder holds `model.safetensors` (the EMA target encoder's weights), `config.json`
(everything needed to rebuild it) and `README.md` (its model card). Loading reads JSON and
safetensors only: no pickle, no trainer, no YAML.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

import torch
import torch.nn as nn

from octfm import config as typed
from train import data
from train.config import ModelConfig, before_v1
from train.model import Encoder

FORMAT = "octfm-encoder"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
HEAD_FILE = "head.safetensors"  # a fine-tuned model folder's task head (`make finetune`, then `make export`)
CONFIG_FILE = "config.json"
ARCH_KEYS = ("tubelet", "stem", "stem_pool", "pool", "dim", "depth", "heads", "mlp_ratio")  # the encoder's part of ModelConfig


# A frozen encoder over cached volumes: centre crop, no augmentation (the one pooling of token
# features into a vector is `Encoder.pool`). Shared by exported encoders, the online probe during
# pretraining and the probes' offline feature extraction, so all of them see the same features.

def center_crop(vol, shape):
    """The central `shape` of the last len(shape) axes (numpy arrays and tensors, batched or not)."""
    lead = vol.ndim - len(shape)
    starts = [(n - s) // 2 for n, s in zip(vol.shape[lead:], shape)]
    return vol[(Ellipsis, *(slice(a, a + s) for a, s in zip(starts, shape)))]


def volume_batches(cache: str, rows: list[dict], stride, shape, batch: int, pad: bool = False
                   ) -> Iterator[tuple[torch.Tensor, int]]:
    """uint8 batches [b, 1, D, H, W] of the rows' volumes (strided, centre-cropped) with the
    count of real rows in each; `pad` fills the last batch with zeros to `batch` rows, so a
    compiled graph sees one shape."""
    for i in range(0, len(rows), batch):
        vols = [torch.from_numpy(np.ascontiguousarray(center_crop(data.read_strided(cache, r, stride), shape)))[None]
                for r in rows[i:i + batch]]
        n = len(vols)
        if pad and n < batch:
            vols += [torch.zeros_like(vols[0])] * (batch - n)
        yield torch.stack(vols), n


def tokens(enc: Encoder, x_u8: torch.Tensor) -> torch.Tensor:
    """Token features [b, N, d] (float32) of uint8 volumes, normalised without jitter."""
    return enc(data.normalize(x_u8)).float()


class Embeddings(NamedTuple):
    pooled: torch.Tensor   # [B, dim] float32
    tokens: torch.Tensor   # [B, N, dim] float32, N = prod(grid)


class CachedVolumeEncoder(nn.Module):
    """A frozen encoder that takes cached uint8 volumes as they are: subsample by `stride`,
    crop the centre to `input_shape`, scale to [0, 1], standardise, encode, pool."""

    def __init__(self, encoder: Encoder, stride, input_shape, mean: float, std: float):
        super().__init__()
        self.encoder = encoder
        self.stride, self.input_shape = tuple(stride), tuple(input_shape)
        self.mean, self.std = float(mean), float(std)

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(self.encoder.grid)

    def prepare(self, volumes: torch.Tensor) -> torch.Tensor:
        """uint8 [B, D, H, W] (or [B, 1, D, H, W]) -> standardised float [B, 1, d, h, w]."""
        if volumes.dtype != torch.uint8:
            raise TypeError(f"expected uint8 cached volumes, got {volumes.dtype}")
        x = volumes if volumes.ndim == 5 else volumes.unsqueeze(1)
        s = self.stride
        x = center_crop(x[..., ::s[0], ::s[1], ::s[2]], self.input_shape)
        if tuple(x.shape[-3:]) != self.input_shape:
            raise ValueError(f"volumes {tuple(volumes.shape[-3:])} after stride {list(s)} are smaller than the "
                             f"encoder's input {list(self.input_shape)}")
        return data.normalize(x, None, self.mean, self.std)

    @torch.no_grad()
    def forward(self, volumes: torch.Tensor) -> Embeddings:
        tokens = self.encoder(self.prepare(volumes)).float()
        return Embeddings(self.encoder.pool(tokens), tokens)  # the probes' and the online probe's pooling


def wrap(enc: Encoder, stride, input_shape) -> CachedVolumeEncoder:
    """A checkpoint's encoder (evals.features.checkpoint_encoder) as `make export` will load it: the
    same module, so `make embed` from a checkpoint and a loaded model folder agree."""
    return CachedVolumeEncoder(enc, stride, input_shape, data.PIXEL_MEAN, data.PIXEL_STD).eval()


def architecture(cfg: dict) -> ModelConfig:
    """The encoder's ModelConfig from a config.json (read_config: it names every key of ARCH_KEYS)."""
    arch_cfg = {k: cfg["architecture"][k] for k in ARCH_KEYS}
    return typed.from_dict(ModelConfig, arch_cfg, where="config.json architecture")


def build(cfg: dict, state: dict[str, torch.Tensor] | None = None) -> CachedVolumeEncoder:
    """The module a config.json describes, with `state` loaded (strictly) when given."""
    arch = architecture(cfg)
    inp, norm = cfg["input"], cfg["normalization"]
    enc = Encoder(arch, inp["input_shape"])
    if state is not None:
        enc.load_state_dict(state)
    return CachedVolumeEncoder(enc, inp["stride"], inp["input_shape"], norm["mean"], norm["std"]).eval()


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not a model folder (write one with `make export CKPT=... OUT=...`)") from None
    if cfg.get("format") != FORMAT or cfg.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {cfg.get('format')!r} version {cfg.get('format_version')!r}; "
                         f"this code reads {FORMAT!r} version {FORMAT_VERSION}")
    lacks = [k for k in ARCH_KEYS if k not in cfg["architecture"]]
    if lacks:  # exported by older code: today's defaults in the gaps would build another encoder
        raise typed.ConfigError(before_v1(f"{path}: a model folder (its architecture lacks {', '.join(lacks)})"))
    return cfg


def load_encoder(folder: str | Path, device: str | torch.device = "cpu") -> CachedVolumeEncoder:
    """The exported encoder of a model folder, in eval mode on `device`."""
    from safetensors.torch import load_file

    cfg = read_config(folder)
    state = load_file(str(Path(folder) / WEIGHTS_FILE), device=str(device))
    return build(cfg, state).to(device)


"""A 3D ViT encoder and a narrow predictor for V-JEPA on OCT volumes.

Tokens are selected by index with one gather (`gather_tokens`) used alike by the context
encoder (visible tokens only), the predictor (positions of context and targets) and the loss.
Attention goes through `train.attention.attend`, which picks the kernel for the backend (flash
on TPU and CUDA). Positions are fixed 3D sin-cos embeddings.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from octfm.config import ConfigError
from train import attention, masks
from train.config import LossConfig, ModelConfig


def sincos_1d(n: int, dim: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    ang = pos * omega[None]
    return torch.cat([ang.sin(), ang.cos()], dim=1)


def sincos_3d(grid: tuple[int, int, int], dim: int) -> torch.Tensor:
    """[T*H*W, dim] fixed positions; the channel budget split over the three axes."""
    d_each = (dim // 6) * 2
    parts = []
    for axis, n in enumerate(grid):
        e = sincos_1d(n, d_each)
        shape = [1, 1, 1, d_each]
        shape[axis] = n
        parts.append(e.reshape(shape).expand(*grid, d_each))
    pe = torch.cat(parts, dim=-1).reshape(-1, 3 * d_each)
    if pe.shape[1] < dim:
        pe = F.pad(pe, (0, dim - pe.shape[1]))
    return pe.float()


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, N, C], idx [B, K] (int32 or int64) -> [B, K, C]: whole rows of the flattened tokens
    (one index_select, whose backward adds rows back), not a gather per element with an index
    expanded over the channels (on XLA a scatter of B x K x C scalars in the backward)."""
    b, n, c = x.shape
    offsets = torch.arange(b, device=idx.device, dtype=idx.dtype).unsqueeze(1) * n
    return x.reshape(b * n, c).index_select(0, (idx + offsets).reshape(-1)).view(b, idx.shape[1], c)


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table [N, C] shared by the batch (positions), idx [B, K] -> [B, K, C]."""
    return table.index_select(0, idx.reshape(-1)).view(*idx.shape, table.shape[-1])


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that keeps a low-precision input in its precision under autocast. CUDA's
    autocast runs every layer norm in float32 and returns float32, which the next Linear casts
    back to bf16: two casts per norm, and a float32 residual stream for whatever adds to the
    output. Here the kernel reads and writes bf16 (its statistics are float32 inside), with the
    weights cast to the input's dtype. float32 inputs, and XLA (whose autocast has its own
    lowering), take nn.LayerNorm's path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or x.device.type == "xla":
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def to_stream(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` (a float32 position table's rows, a learned token) in the dtype of the residual stream
    it joins, `like`: added as float32 it would promote the whole stream to float32 under autocast."""
    return t.to(like.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = attention.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.drop_path = 0.0  # stochastic depth while training (fine-tuning sets it: set_drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.norm1(x)))
        return x + self._drop(self.mlp(self.norm2(x)))

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        """Each sample's residual branch dropped with probability drop_path (kept ones scaled up)."""
        if not self.training or self.drop_path <= 0:
            return y
        keep = 1.0 - self.drop_path
        return y * torch.empty(y.shape[0], *(1,) * (y.dim() - 1), device=y.device, dtype=y.dtype).bernoulli_(keep) / keep


def set_drop_path(encoder: "Encoder", rate: float) -> None:
    """Stochastic depth rising linearly over the blocks from 0 to `rate` at the last."""
    n = len(encoder.blocks)
    for i, blk in enumerate(encoder.blocks):
        blk.drop_path = rate * i / max(1, n - 1)


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


STEM_STRIDE = (1, 2, 2)  # each stem convolution halves rows and columns (frames are few already)


def conv_stem(channels) -> nn.Module:
    """3 x 3 x 3 convolutions + GELU, each halving rows and columns: local detectors whose
    responses the tubelet patchify then sums wherever they fall inside a tubelet (identity
    when `channels` is empty)."""
    layers, c_in = [], 1
    for c in channels:
        layers += [nn.Conv3d(c_in, c, kernel_size=3, stride=STEM_STRIDE, padding=1), nn.GELU()]
        c_in = c
    return nn.Sequential(*layers)


def patchify(x: torch.Tensor, conv: nn.Conv3d) -> torch.Tensor:
    """[B, C, D, H, W] -> [B, N, dim]: `conv` (kernel = stride, no overlap) as one matmul over
    the tubelets laid out as rows, tokens in the grid's order. The same numbers as the
    convolution, cheaper to differentiate on a CPU (oneDNN's convolution backward was most of
    a learning-check step's patchify, docs/measurements.md); the weights keep the Conv3d layout."""
    b, c, d, h, w = x.shape
    kd, kh, kw = conv.kernel_size
    rows = x.reshape(b, c, d // kd, kd, h // kh, kh, w // kw, kw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return F.linear(rows.reshape(b, (d // kd) * (h // kh) * (w // kw), c * kd * kh * kw),
                    conv.weight.reshape(conv.weight.shape[0], -1), conv.bias)


def patch_kernel(tubelet, stem) -> tuple[int, int, int]:
    """The patchify's kernel after the stem's strides: the tubelet, divided."""
    k = [t // s ** len(stem) for t, s in zip(tubelet, STEM_STRIDE)]
    if any(kk * s ** len(stem) != t for kk, s, t in zip(k, STEM_STRIDE, tubelet)):
        raise ConfigError(f"model.tubelet {list(tubelet)} is not divisible by the strides of model.stem "
                         f"({len(stem)} x {list(STEM_STRIDE)})")
    return tuple(k)


class Encoder(nn.Module):
    """Patchify [B, 1, D, H, W] into tubelets, add positions, keep `idx` tokens, transform."""

    def __init__(self, cfg: ModelConfig, input_shape):
        super().__init__()
        self.grid = dataclasses.astuple(masks.grid_for(input_shape, cfg.tubelet))
        self.stem = conv_stem(cfg.stem)
        k = patch_kernel(cfg.tubelet, cfg.stem)
        c = cfg.stem[-1] if cfg.stem else 1
        self.patch = nn.Conv3d(c, cfg.dim, kernel_size=k, stride=k)
        self.peak = nn.Conv3d(c, cfg.dim, kernel_size=1) if cfg.stem_pool == "max" else None
        self.pooling = cfg.pool
        self.register_buffer("pos", sincos_3d(self.grid, cfg.dim), persistent=False)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.norm = LayerNorm(cfg.dim)
        self.apply(_init_weights)
        w = self.patch.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))

    @property
    def num_tokens(self) -> int:
        return math.prod(self.grid)

    def pool(self, h: torch.Tensor) -> torch.Tensor:
        """[B, N, dim] token features -> [B, dim] as `model.pool` says (the one pooling every
        probe, the online probe, the supervised reference and exported encoders use)."""
        return h.amax(1) if self.pooling == "max" else h.mean(1)

    def pool_grid(self, h: torch.Tensor, kernel) -> torch.Tensor:
        """[B, N, dim] -> [B, N', dim]: the token grid pooled in blocks of `kernel` tokens, the same
        kind of pooling as `pool` (the attentive probe's coarser tokens)."""
        grid = h.transpose(1, 2).reshape(h.shape[0], h.shape[2], *self.grid)
        fn = F.max_pool3d if self.pooling == "max" else F.avg_pool3d
        return fn(grid, kernel_size=tuple(kernel), ceil_mode=True).flatten(2).transpose(1, 2)

    def tokenize(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 1, D, H, W] -> [B, N, dim]: the patchify of the stem's responses, plus (with
        `model.stem_pool: max`) a projection of each channel's peak inside the tubelet, which
        reads alike wherever in the tubelet a small lesion falls."""
        s = self.stem(x)
        t = patchify(s, self.patch)
        if self.peak is not None:
            peaks = F.max_pool3d(s, self.patch.kernel_size).flatten(2).transpose(1, 2)  # [B, N, C]
            t = t + F.linear(peaks, self.peak.weight.flatten(1), self.peak.bias)
        return t + to_stream(self.pos, t)

    def forward(self, x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        return self.transform(self.tokenize(x), idx)

    def transform(self, tokens: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks on `tokenize`'s output (its `idx` tokens): a step tokenises once and
        gathers each mask set's context from it."""
        t = tokens if idx is None else gather_tokens(tokens, idx)
        for blk in self.blocks:
            t = blk(t)
        return self.norm(t)


class Predictor(nn.Module):
    """Narrow transformer: context features + a learned mask token at each target position."""

    def __init__(self, cfg: ModelConfig, grid):
        super().__init__()
        self.embed = nn.Linear(cfg.dim, cfg.pred_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.pred_dim))
        self.register_buffer("pos", sincos_3d(tuple(grid), cfg.pred_dim), persistent=False)
        self.blocks = nn.ModuleList(Block(cfg.pred_dim, cfg.pred_heads, cfg.mlp_ratio) for _ in range(cfg.pred_depth))
        self.norm = LayerNorm(cfg.pred_dim)
        self.out = nn.Linear(cfg.pred_dim, cfg.dim)
        self.apply(_init_weights)
        nn.init.trunc_normal_(self.mask_token, std=0.02)

    def forward(self, ctx: torch.Tensor, ctx_idx: torch.Tensor, tgt_idx: torch.Tensor) -> torch.Tensor:
        """Predictions at the target positions."""
        b = ctx.shape[0]
        c = self.embed(ctx)
        c = c + to_stream(gather_rows(self.pos, ctx_idx), c)
        m = to_stream(self.mask_token.expand(b, tgt_idx.shape[1], -1) + gather_rows(self.pos, tgt_idx), c)
        x = torch.cat([c, m], dim=1)
        for blk in self.blocks:
            x = blk(x)
        return self.out(self.norm(x[:, c.shape[1]:]))


def cells_per_tubelet(tubelet, cell) -> tuple[int, int, int]:
    """How many `cell` blocks fit along each axis of a tubelet (they must tile it)."""
    per = tuple(t // c for t, c in zip(tubelet, cell))
    if any(p * c != t for p, c, t in zip(per, cell, tubelet)):
        raise ConfigError(f"loss.local_cell {list(cell)} does not divide model.tubelet {list(tubelet)}")
    return per


def local_outputs(loss: LossConfig, tubelet) -> int:
    """The local head's outputs per token: one per cell of the tubelet."""
    return math.prod(cells_per_tubelet(tubelet, loss.local_cell))


def local_cells(x: torch.Tensor, tubelet, cell) -> torch.Tensor:
    """[B, 1, D, H, W] -> [B, N, cells per tubelet]: per token (in the patchify's order), the mean
    of its tubelet's voxels in each `cell` block: the cell's level with the speckle averaged
    (docs/recipe.md, The objective)."""
    per = cells_per_tubelet(tubelet, cell)
    b = x.shape[0]
    grid = dataclasses.astuple(masks.grid_for(x.shape[2:], tubelet))
    m = F.avg_pool3d(x, cell).reshape(b, grid[0], per[0], grid[1], per[1], grid[2], per[2])
    return m.permute(0, 1, 3, 5, 2, 4, 6).reshape(b, math.prod(grid), math.prod(per))


def objective(loss: LossConfig) -> str:
    """The pretraining objective in words, for run summaries, exported config.json and model
    cards: a run with the local term is not plain V-JEPA and must not be called so."""
    if loss.local == 0:
        return "V-JEPA latent prediction"
    return f"V-JEPA latent prediction + local intensity term (tubelet mean cells), weights 1 / {loss.local:g}"


class JEPA(nn.Module):
    """The trained student: context encoder + predictor. The loss for each mask set is
    the L1 between predictions and the target encoder's layer-normed features at the target
    tokens, plus (with `loss.local` > 0) `loss.local` x the L1 of a linear head
    reading each context token's own tubelet cells (`local_cells`) from its output."""

    def __init__(self, cfg: ModelConfig, input_shape, loss: LossConfig | None = None):
        super().__init__()
        self.encoder = Encoder(cfg, input_shape)
        self.predictor = Predictor(cfg, self.encoder.grid)
        self.tubelet = tuple(cfg.tubelet)
        self.loss = loss or LossConfig()
        self.local_head = None
        if self.loss.local > 0:
            self.local_head = nn.Linear(cfg.dim, local_outputs(self.loss, cfg.tubelet))
            _init_weights(self.local_head)

    def forward(self, x: torch.Tensor, masks: list[tuple[torch.Tensor, torch.Tensor]],
                targets: torch.Tensor) -> torch.Tensor:
        """`masks`: (context ids, target ids) per mask set."""
        cells = None if self.local_head is None else local_cells(x, self.tubelet, self.loss.local_cell)
        tokens = self.encoder.tokenize(x)  # once: the stem and patchify are a third of a step at check size
        losses = []
        for ctx_idx, tgt_idx in masks:
            ctx = self.encoder.transform(tokens, ctx_idx)
            pred = self.predictor(ctx, ctx_idx, tgt_idx)
            tgt = gather_tokens(targets, tgt_idx)
            loss = (pred.float() - tgt.float()).abs().mean()
            if cells is not None:
                err = (self.local_head(ctx).float() - gather_tokens(cells, ctx_idx)).abs().mean(-1)  # [B, Kc]
                loss = loss + self.loss.local * context_mean(err)
            losses.append(loss)
        return torch.stack(losses).mean()


def context_mean(err: torch.Tensor) -> torch.Tensor:
    """The mean of a per-context-token error [B, Kc], as its sum divided by the count held in a
    tensor on err's device: CUDA's `mean()`, and its division by a Python number, multiply by the
    reciprocal instead, which can move the local term in its last bit."""
    return err.sum() / err.new_full((), err.numel())


@torch.no_grad()
def target_features(target_encoder: Encoder, x: torch.Tensor) -> torch.Tensor:
    """All tokens through the EMA encoder, layer-normed per token (the regression targets)."""
    h = target_encoder(x)
    return F.layer_norm(h.float(), (h.shape[-1],))

"""Many probe heads trained at once on frozen features: a grid of learning rate x weight
decay for a linear probe (the pooled tokens, `model.pool`), an attentive probe (learned queries
attend over the tokens), and a readout for a few informative tokens among many (issue 41):
gated-attention multiple-instance pooling. (A top-k readout of per-token class scores was tried
and left out: on the two-marked-tokens test of tests/test_probe.py it trained to 0.48 or to 0.95
depending on the learning rate and the number of bags; docs/learning-check.md, decision 9.)
Heads share nothing, so one summed loss trains them all. The same heads
sit on a fine-tuned encoder (`make finetune`); `load_classifier` reads one from its model folder."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from train import encoder


class LinearHeads(nn.Module):
    def __init__(self, n_heads: int, dim: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.w = nn.Parameter(torch.zeros(n_heads, dim, classes))
        self.b = nn.Parameter(torch.zeros(n_heads, classes))

    def forward(self, pooled: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm(pooled)                                   # [B, d]
        return torch.einsum("bd,hdc->bhc", x, self.w) + self.b  # [B, H, C]


class AttentiveHeads(nn.Module):
    """Cross-attention pooling: per head, `queries` learned vectors attend over the (normed)
    tokens; the pooled vectors feed a linear classifier. (A key or value projection would
    fold into the query and the classifier, so none is learned.)"""

    def __init__(self, n_heads: int, dim: int, classes: int, queries: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.q = nn.Parameter(torch.randn(n_heads, queries, dim) * 0.02)
        self.w = nn.Parameter(torch.zeros(n_heads, queries * dim, classes))
        self.b = nn.Parameter(torch.zeros(n_heads, classes))

    def forward(self, pooled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        t = self.norm(tokens)                                                   # [B, N, d]
        att = torch.softmax(torch.einsum("bnd,hqd->bhqn", t, self.q) / math.sqrt(t.shape[-1]), dim=-1)
        z = torch.einsum("bhqn,bnd->bhqd", att, t).flatten(2)                   # [B, H, Q*d]
        return torch.einsum("bhd,hdc->bhc", z, self.w) + self.b


class GatedMILHeads(nn.Module):
    """Gated-attention multiple-instance pooling (Ilse, Tomczak and Welling, ICML 2018): a small
    gated network scores each token, the softmax of the scores weights the tokens, and a linear
    classifier reads the weighted sum. Unlike the attentive head's fixed queries, the score is a
    nonlinear function of the token, so it can single out a rare kind of token."""

    def __init__(self, n_heads: int, dim: int, classes: int, hidden: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.v = nn.Parameter(torch.randn(n_heads, dim, hidden) / math.sqrt(dim))
        self.u = nn.Parameter(torch.randn(n_heads, dim, hidden) / math.sqrt(dim))
        self.a = nn.Parameter(torch.zeros(n_heads, hidden))                       # uniform weights at first
        self.w = nn.Parameter(torch.zeros(n_heads, dim, classes))
        self.b = nn.Parameter(torch.zeros(n_heads, classes))

    def forward(self, pooled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        t = self.norm(tokens)                                                   # [B, N, d]
        gate = torch.tanh(torch.einsum("bnd,hdk->bhnk", t, self.v)) * torch.sigmoid(torch.einsum("bnd,hdk->bhnk", t, self.u))
        att = torch.softmax(torch.einsum("bhnk,hk->bhn", gate, self.a), dim=-1)
        z = torch.einsum("bhn,bnd->bhd", att, t)
        return torch.einsum("bhd,hdc->bhc", z, self.w) + self.b


HEADS = {"linear": LinearHeads, "attentive": AttentiveHeads, "mil": GatedMILHeads}


def make_heads(kind: str, n_heads: int, dim: int, classes: int) -> nn.Module:
    if kind not in HEADS:
        raise ValueError(f"head kind {kind!r}: one of {', '.join(HEADS)}")
    return HEADS[kind](n_heads, dim, classes)


def reads_tokens(kind: str) -> bool:
    """Whether a head kind reads the (grid-pooled) tokens rather than the pooled vector."""
    return kind != "linear"


def class_weights(y, classes: int) -> torch.Tensor:
    """Balanced cross-entropy weights: n / (classes x count) per class, 0 for an absent class."""
    counts = np.bincount(np.asarray(y), minlength=classes).astype(np.float64)
    return torch.tensor(np.where(counts > 0, counts.sum() / np.maximum(counts, 1) / classes, 0.0), dtype=torch.float32)


class ChannelScaler(nn.Module):
    """Each feature channel to zero mean and unit variance, by the statistics of the rows a head
    trains on (for the tokens, over every token of those rows). Self-supervised features are
    anisotropic even after the heads' per-token norm: a few directions hold most of the variance,
    and an attentive head's queries then read little else (docs/learning-check.md, decisions 20-21;
    MAE probes through a per-channel BatchNorm for the same reason). A channel constant on those
    rows is left unscaled (it would otherwise be multiplied by a million wherever it moves).
    `on` False: the identity, with no statistics computed. The statistics are buffers: a fine-tuned
    head saves and exports them with its weights (decision 37)."""

    CHUNK = 256  # rows per pass: float64 statistics without a float64 copy of every token

    def __init__(self, x: np.ndarray, on: bool = True):
        super().__init__()
        self.on = on
        if not on:
            return
        d, n = x.shape[-1], max(1, math.prod(x.shape[:-1]))
        total = np.zeros(d)
        for i in range(0, len(x), self.CHUNK):
            total += x[i:i + self.CHUNK].reshape(-1, d).sum(0, dtype=np.float64)
        mean = total / n
        sq = np.zeros(d)
        for i in range(0, len(x), self.CHUNK):
            sq += np.square(x[i:i + self.CHUNK].reshape(-1, d).astype(np.float64) - mean).sum(0)
        std = np.sqrt(sq / n)
        self.register_buffer("mean", torch.from_numpy(mean.astype(np.float32)))
        self.register_buffer("std", torch.from_numpy(np.where(std > 1e-6, std + 1e-6, 1.0).astype(np.float32)))

    @classmethod
    def of_width(cls, dim: int) -> "ChannelScaler":
        """Buffers of `dim` channels to load saved statistics into (load_state_dict)."""
        return cls(np.zeros((1, dim), np.float32))

    @classmethod
    def identity(cls) -> "ChannelScaler":
        """The scaler of a head trained with standardize: false: the identity, with no buffers to save or load."""
        return cls(np.zeros((1, 1), np.float32), on=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [..., d], scaled where `on`."""
        return (x - self.mean) / self.std if self.on else x


class ScaledHeads(nn.Module):
    """Heads that read their inputs through fixed ChannelScalers (the tokens' only for a head that
    reads tokens): fine-tuning's head, whose statistics are the starting encoder's over the train
    rows (evals/finetune.py; decision 37)."""

    def __init__(self, heads: nn.Module, scale_p: ChannelScaler, scale_t: ChannelScaler | None = None):
        super().__init__()
        self.heads, self.scale_p, self.scale_t = heads, scale_p, scale_t

    def forward(self, pooled: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        t = self.scale_t(tokens.float()) if self.scale_t is not None and tokens is not None else tokens
        return self.heads(self.scale_p(pooled.float()), t)

    def one(self, h: int) -> "ScaledHeads":
        """The grid's head `h` alone (every head keeps its weights stacked on dim 0), behind the same
        scalers: a fitted probe head as fine-tuning's first head (decision 38)."""
        heads = copy.deepcopy(self.heads)
        for p in heads.parameters():
            p.data = p.data[h:h + 1].clone()
        return ScaledHeads(heads, copy.deepcopy(self.scale_p), copy.deepcopy(self.scale_t))


class HeadGrid:
    """A grid of heads trained at once (train_heads); called on features, every head's class
    probabilities [H, n, C], one batch at a time on the device they trained on."""

    def __init__(self, heads: ScaledHeads, device: torch.device):
        self.heads, self.device = heads, device

    def one(self, h: int) -> ScaledHeads:
        """Head `h` of the grid alone, behind the same scalers (ScaledHeads.one)."""
        return self.heads.one(h)

    @torch.no_grad()
    def __call__(self, pooled_x: np.ndarray, tokens_x: np.ndarray | None) -> np.ndarray:
        self.heads.eval()
        out = []
        for i in range(0, len(pooled_x), 256):
            p = torch.from_numpy(pooled_x[i:i + 256]).float().to(self.device)
            t = torch.from_numpy(tokens_x[i:i + 256]).float().to(self.device) if tokens_x is not None else None
            out.append(torch.softmax(self.heads(p, t), dim=-1).cpu().numpy())
        return np.concatenate(out, 0).transpose(1, 0, 2)                        # [H, n, C]


def head_epochs(rows: int, batch: int, epochs: int, min_steps: int) -> int:
    """`epochs`, or more where that many epochs of `rows` take fewer than `min_steps` optimizer steps
    (decision 32: a label fraction's heads get the full split's updates, not a fraction of them)."""
    return max(epochs, math.ceil(min_steps / max(1, math.ceil(rows / batch))))


def train_heads(kind: str, grid: list[tuple[float, float]], pooled: np.ndarray, tokens: np.ndarray | None,
                y: np.ndarray, classes: int, epochs: int, batch: int, seed: int, class_weight: bool = True, *,
                standardize: bool, device: str | torch.device = "cpu", min_steps: int = 0) -> HeadGrid:
    """Train one head per (lr, wd) on the training features; returns them as a HeadGrid (called on
    features: every head's probabilities). With `standardize` every channel is scaled by the
    training rows' statistics (ChannelScaler), in training and in prediction alike, one batch at a
    time. `device`: where the heads train and
    predict (at GPU size the attentive heads read 2,250 volumes x 72 pooled tokens x 384 channels;
    the headline probes took 589 s of host CPU on the H200's machine, docs/accelerators.md); the
    features, the initial weights and the batch order are the same on any device. `min_steps`: at
    least this many optimizer steps (head_epochs)."""
    dev = torch.device(device)
    torch.manual_seed(seed)
    heads = make_heads(kind, len(grid), pooled.shape[1], classes).to(dev)
    opt = _HeadAdamW(heads, grid)
    weight = class_weights(y, classes).to(dev) if class_weight else None
    model = ScaledHeads(heads, ChannelScaler(pooled, standardize),
                        ChannelScaler(tokens, standardize) if tokens is not None else None).to(dev)
    P = torch.from_numpy(pooled).float().to(dev)
    T = torch.from_numpy(tokens).float().to(dev) if tokens is not None else None
    Y = torch.from_numpy(y).long().to(dev)
    g = torch.Generator().manual_seed(seed)
    for _ in range(head_epochs(len(y), batch, epochs, min_steps)):
        perm = torch.randperm(len(Y), generator=g).to(dev)
        for i in range(0, len(Y), batch):
            idx = perm[i:i + batch]
            logits = model(P[idx], T[idx] if T is not None else None)   # [b, H, C]
            loss = F.cross_entropy(logits.reshape(-1, classes), Y[idx].repeat_interleave(len(grid)),
                                   weight=weight, reduction="mean") * len(grid)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return HeadGrid(model, dev)


class _HeadAdamW:
    """AdamW whose learning rate and weight decay differ per head (slice 0 of each stacked
    parameter), so a whole grid trains in one pass."""

    def __init__(self, module: nn.Module, grid, betas=(0.9, 0.999), eps=1e-8):
        self.params = [p for p in module.parameters()]
        dev = self.params[0].device
        self.lr = torch.tensor([lr for lr, _ in grid], dtype=torch.float32, device=dev)
        self.wd = torch.tensor([wd for _, wd in grid], dtype=torch.float32, device=dev)
        self.betas, self.eps, self.t = betas, eps, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            shape = (-1,) + (1,) * (p.ndim - 1)
            lr, wd = self.lr.view(shape), self.wd.view(shape)
            p.mul_(1 - lr * wd)
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            mhat, vhat = m / (1 - b1 ** self.t), v / (1 - b2 ** self.t)
            p.sub_(lr * mhat / (vhat.sqrt() + self.eps))


class CachedVolumeClassifier(nn.Module):
    """A fine-tuned model folder: the encoder and its task head, cached uint8 volumes in, class
    probabilities [B, classes] out (names in `classes`)."""

    def __init__(self, enc: encoder.CachedVolumeEncoder, head: nn.Module, kind: str, token_pool, classes: list[str]):
        super().__init__()
        self.encoder, self.head, self.kind = enc, head, kind
        self.token_pool, self.classes = tuple(token_pool), list(classes)

    @torch.no_grad()
    def forward(self, volumes: torch.Tensor) -> torch.Tensor:
        out = self.encoder(volumes)
        tokens = self.encoder.encoder.pool_grid(out.tokens, self.token_pool) if reads_tokens(self.kind) else None
        return torch.softmax(self.head(out.pooled, tokens)[:, 0].float(), -1)


def shaped_like(kind: str, head: nn.Module, state: dict) -> nn.Module:
    """`head` (make_heads' one head of `kind`) shaped as the saved `state`: behind ChannelScalers
    where it was saved behind them (fine-tuning's standardised or fitted heads, decisions 37-38),
    with empty statistics to load into; a bare head's state (older runs) leaves it bare."""
    if not any(k.startswith("heads.") for k in state):
        return head

    def scaler(name: str) -> ChannelScaler:
        w = state.get(f"{name}.mean")
        return ChannelScaler.of_width(w.shape[0]) if w is not None else ChannelScaler.identity()
    tokens = "scale_t.mean" in state or reads_tokens(kind)
    return ScaledHeads(head, scaler("scale_p"), scaler("scale_t") if tokens else None)


def load_classifier(folder: str | Path, device: str | torch.device = "cpu") -> CachedVolumeClassifier:
    """The encoder and task head of a fine-tuned model folder, in eval mode on `device`."""
    from safetensors.torch import load_file

    cfg = encoder.read_config(folder)
    if "head" not in cfg:
        raise ValueError(f"{Path(folder) / encoder.CONFIG_FILE}: no task head (a pretrained encoder; `make finetune` "
                         "then `make export` writes one)")
    h = cfg["head"]
    dim, state = cfg["architecture"]["dim"], load_file(str(Path(folder) / h["file"]))
    head = shaped_like(h["kind"], make_heads(h["kind"], 1, dim, len(h["classes"])), state)
    head.load_state_dict(state)
    return CachedVolumeClassifier(encoder.load_encoder(folder), head, h["kind"], h["token_pool"], h["classes"]).to(device).eval()

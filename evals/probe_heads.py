"""Many probe heads trained at once on frozen features: a grid of learning rate x weight
decay for a linear probe (the pooled tokens, `model.pool`), an attentive probe (learned queries
attend over the tokens), and a readout for a few informative tokens among many (check/token_probe.py):
gated-attention multiple-instance pooling. (A top-k readout of per-token class scores was tried
and left out: on the two-marked-tokens test of tests/test_probe.py it trained to 0.48 or to 0.95
depending on the learning rate and the number of bags; docs/history/learning-check.md, a readout
for a few tokens.)
Heads share nothing, so one summed loss trains them all, and several encoders' grids train as one
(inputs with a leading encoder axis: the heads of encoder e are e's slice of every stacked
parameter; fewer, larger steps on a CPU, where a head's step is mostly overhead). The same heads
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


def by_encoder(param: torch.Tensor, encoders: int) -> torch.Tensor:
    """A stacked parameter [H, ...] as [encoders, H / encoders, ...]: each encoder's heads (encoder-major)."""
    return param.view(encoders, param.shape[0] // encoders, *param.shape[1:])


class Heads(nn.Module):
    """A stack of heads, one per row of every parameter. The forward is `read(*prepare(...))`:
    `prepare` is its fixed part (the input's norm, no parameters), which a fit applies once to all
    its rows instead of to every batch (train_heads)."""

    def forward(self, pooled: torch.Tensor | None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.read(*self.prepare(pooled, tokens))


class LinearHeads(Heads):
    def __init__(self, n_heads: int, dim: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.w = nn.Parameter(torch.zeros(n_heads, dim, classes))
        self.b = nn.Parameter(torch.zeros(n_heads, classes))

    def prepare(self, pooled: torch.Tensor, tokens: torch.Tensor | None = None):
        """The fixed part of the forward (no parameters): the pooled vector's norm."""
        return self.norm(pooled), None

    def read(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, H, C] of prepared inputs ([B, d], or [E, B, d]: one set per encoder)."""
        if x.dim() == 2:
            return torch.einsum("bd,hdc->bhc", x, self.w) + self.b  # [B, H, C]
        w = by_encoder(self.w, x.shape[0])
        return torch.einsum("ebd,egdc->begc", x, w).flatten(1, 2) + self.b


class AttentiveHeads(Heads):
    """Cross-attention pooling: per head, `queries` learned vectors attend over the (normed)
    tokens; the pooled vectors feed a linear classifier. (A key or value projection would
    fold into the query and the classifier, so none is learned.)"""

    def __init__(self, n_heads: int, dim: int, classes: int, queries: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.q = nn.Parameter(torch.randn(n_heads, queries, dim) * 0.02)
        self.w = nn.Parameter(torch.zeros(n_heads, queries * dim, classes))
        self.b = nn.Parameter(torch.zeros(n_heads, classes))

    def prepare(self, pooled: torch.Tensor | None, tokens: torch.Tensor):
        """The fixed part of the forward (no parameters): the tokens' norm."""
        return None, self.norm(tokens)

    def read(self, pooled: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
        """Logits [B, H, C] of prepared tokens ([B, N, d], or [E, B, N, d])."""
        if t.dim() == 3:
            att = torch.softmax(torch.einsum("bnd,hqd->bhqn", t, self.q) / math.sqrt(t.shape[-1]), dim=-1)
            z = torch.einsum("bhqn,bnd->bhqd", att, t).flatten(2)               # [B, H, Q*d]
            return torch.einsum("bhd,hdc->bhc", z, self.w) + self.b
        e = t.shape[0]
        att = torch.softmax(torch.einsum("ebnd,egqd->ebgqn", t, by_encoder(self.q, e)) / math.sqrt(t.shape[-1]), dim=-1)
        z = torch.einsum("ebgqn,ebnd->ebgqd", att, t).flatten(3)                # [E, B, G, Q*d]
        return torch.einsum("ebgk,egkc->begc", z, by_encoder(self.w, e)).flatten(1, 2) + self.b


class GatedMILHeads(Heads):
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

    prepare = AttentiveHeads.prepare

    def read(self, pooled: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
        """Logits [B, H, C] of prepared tokens ([B, N, d], or [E, B, N, d])."""
        if t.dim() == 3:
            gate = torch.tanh(torch.einsum("bnd,hdk->bhnk", t, self.v)) * torch.sigmoid(torch.einsum("bnd,hdk->bhnk", t, self.u))
            att = torch.softmax(torch.einsum("bhnk,hk->bhn", gate, self.a), dim=-1)
            z = torch.einsum("bhn,bnd->bhd", att, t)
            return torch.einsum("bhd,hdc->bhc", z, self.w) + self.b
        v, u, a, w = (by_encoder(p, t.shape[0]) for p in (self.v, self.u, self.a, self.w))
        gate = torch.tanh(torch.einsum("ebnd,egdk->ebgnk", t, v)) * torch.sigmoid(torch.einsum("ebnd,egdk->ebgnk", t, u))
        att = torch.softmax(torch.einsum("ebgnk,egk->ebgn", gate, a), dim=-1)
        z = torch.einsum("ebgn,ebnd->ebgd", att, t)
        return torch.einsum("ebgd,egdc->begc", z, w).flatten(1, 2) + self.b


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
    and an attentive head's queries then read little else (docs/recipe.md, Probes;
    MAE probes through a per-channel BatchNorm for the same reason). A channel constant on those
    rows is left unscaled (it would otherwise be multiplied by a million wherever it moves).
    `on` False: the identity, with no statistics computed. The statistics are buffers: a fine-tuned
    head saves and exports them with its weights (docs/recipe.md, Fine-tuning)."""

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
    def stacked(cls, xs: list[np.ndarray], on: bool = True) -> "ChannelScaler":
        """One scaler for several encoders' features (inputs [E, ..., d]): encoder e's channels by
        e's own training rows, as a scaler of those rows alone would."""
        out = cls(xs[0], on)
        if on:
            each = [out, *(cls(x) for x in xs[1:])]
            out.mean, out.std = torch.stack([s.mean for s in each]), torch.stack([s.std for s in each])  # [E, d]
        return out

    def row(self, e: int) -> "ChannelScaler":
        """Encoder `e`'s scaler of a stacked one (itself when not stacked)."""
        if not self.on or self.mean.dim() == 1:
            return self
        out = copy.deepcopy(self)
        out.mean, out.std = self.mean[e].clone(), self.std[e].clone()
        return out

    @classmethod
    def identity(cls) -> "ChannelScaler":
        """The scaler of a head trained with standardize: false: the identity, with no buffers to save or load."""
        return cls(np.zeros((1, 1), np.float32), on=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [..., d] (stacked: [E, ..., d]), scaled where `on`."""
        if not self.on:
            return x
        if self.mean.dim() == 1:
            return (x - self.mean) / self.std
        shape = (self.mean.shape[0],) + (1,) * (x.dim() - 2) + (self.mean.shape[1],)
        return (x - self.mean.view(shape)) / self.std.view(shape)


class ScaledHeads(nn.Module):
    """Heads that read their inputs through fixed ChannelScalers (the tokens' only for a head that
    reads tokens): fine-tuning's head, whose statistics are the starting encoder's over the train
    rows (evals/finetune.py; docs/recipe.md, Fine-tuning)."""

    def __init__(self, heads: nn.Module, scale_p: ChannelScaler, scale_t: ChannelScaler | None = None):
        super().__init__()
        self.heads, self.scale_p, self.scale_t = heads, scale_p, scale_t

    def forward(self, pooled: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.heads.read(*self.prepare(pooled, tokens))

    def prepare(self, pooled: torch.Tensor, tokens: torch.Tensor | None = None):
        """The fixed part of the forward (the scalers and the heads' norm): what `heads.read` takes."""
        t = self.scale_t(tokens.float()) if self.scale_t is not None and tokens is not None else tokens
        return self.heads.prepare(self.scale_p(pooled.float()), t)

    def part(self, lo: int, hi: int, encoder: int = 0) -> "ScaledHeads":
        """Heads lo..hi of the stack, behind encoder `encoder`'s scalers (of a stacked grid, its
        own; else the only ones)."""
        heads = copy.deepcopy(self.heads)
        for p in heads.parameters():
            p.data = p.data[lo:hi].clone()
        t = self.scale_t.row(encoder) if self.scale_t is not None else None
        return ScaledHeads(heads, copy.deepcopy(self.scale_p.row(encoder)), copy.deepcopy(t))


class HeadGrid:
    """A grid of heads trained at once (train_heads); called on features, every head's class
    probabilities [H, n, C], one batch at a time on the device they trained on. A grid of several
    encoders (`encoders` > 1) is called on a list of their features, heads encoder-major."""

    def __init__(self, heads: ScaledHeads, device: torch.device, encoders: int = 1):
        self.heads, self.device, self.encoders = heads, device, encoders

    def encoder(self, e: int) -> "HeadGrid":
        """Encoder `e`'s heads of a stacked grid, as a grid of that encoder alone (called on its features)."""
        g = self.heads.heads.b.shape[0] // self.encoders
        return HeadGrid(self.heads.part(e * g, (e + 1) * g, e), self.device)

    @staticmethod
    def _batch(x, i: int, device) -> torch.Tensor | None:
        if x is None:
            return None
        b = np.stack([a[i:i + 256] for a in x]) if isinstance(x, list) else x[i:i + 256]
        return torch.from_numpy(b).float().to(device)

    @torch.no_grad()
    def __call__(self, pooled_x, tokens_x) -> np.ndarray:
        self.heads.eval()
        out = []
        for i in range(0, len(pooled_x[0] if isinstance(pooled_x, list) else pooled_x), 256):
            p, t = self._batch(pooled_x, i, self.device), self._batch(tokens_x, i, self.device)
            out.append(torch.softmax(self.heads(p, t), dim=-1).cpu().numpy())
        return np.concatenate(out, 0).transpose(1, 0, 2)                        # [H, n, C]


def head_epochs(rows: int, batch: int, epochs: int, min_steps: int) -> int:
    """`epochs`, or more where that many epochs of `rows` take fewer than `min_steps` optimizer steps
    (a label fraction's heads get the full split's updates, not a fraction of them: docs/recipe.md, Probes)."""
    return max(epochs, math.ceil(min_steps / max(1, math.ceil(rows / batch))))


def train_heads(kind: str, grid: list[tuple[float, float]], pooled, tokens, y: np.ndarray, classes: int,
                epochs: int, batch: int, seed: int, class_weight: bool = True, *, standardize: bool,
                device: str | torch.device = "cpu", min_steps: int = 0) -> HeadGrid:
    """Train one head per (lr, wd) on the training features; returns them as a HeadGrid (called on
    features: every head's probabilities). With `standardize` every channel is scaled by the
    training rows' statistics (ChannelScaler), in training and in prediction alike, one batch at a
    time. `device`: where the heads train and
    predict (at GPU size the attentive heads read 2,250 volumes x 72 pooled tokens x 384 channels;
    the headline probes took 589 s of host CPU on the H200's machine, docs/accelerators.md); the
    features, the initial weights and the batch order are the same on any device. `min_steps`: at
    least this many optimizer steps (head_epochs).

    `pooled` and `tokens` as lists: several encoders' features of the same rows, each with its own
    grid, trained as one stack (the same initial weights, batches and updates each gets alone; the
    sums in a step differ in float rounding only); the HeadGrid's `encoder(e)` is encoder e's grid."""
    dev = torch.device(device)
    stacked = isinstance(pooled, list)
    n_enc = len(pooled) if stacked else 1
    torch.manual_seed(seed)
    heads = make_heads(kind, len(grid), (pooled[0] if stacked else pooled).shape[1], classes)
    if stacked:  # every encoder's grid starts where one grid alone would
        for p in heads.parameters():
            p.data = p.data.repeat(n_enc, *(1,) * (p.ndim - 1))
    heads = heads.to(dev)
    opt = _HeadAdamW(heads, grid * n_enc)
    weight = class_weights(y, classes).to(dev) if class_weight else None
    scaler = ChannelScaler.stacked if stacked else ChannelScaler
    model = ScaledHeads(heads, scaler(pooled, standardize),
                        scaler(tokens, standardize) if tokens is not None else None).to(dev)

    def tensor(x, part: slice):  # those rows as float32 on the device ([E, rows, ...] when stacked)
        return None if x is None else torch.from_numpy(np.stack([a[part] for a in x]) if stacked else x[part]).float().to(dev)
    rows = (slice(None),) if stacked else ()
    P, T = prepared(model, lambda part: (tensor(pooled, part), tensor(tokens, part)), len(y), len(rows))
    Y = torch.from_numpy(y).long().to(dev)
    n_heads = len(grid) * n_enc
    g = torch.Generator().manual_seed(seed)
    for _ in range(head_epochs(len(y), batch, epochs, min_steps)):
        perm = torch.randperm(len(Y), generator=g).to(dev)
        for i in range(0, len(Y), batch):
            idx = perm[i:i + batch]
            logits = heads.read(*(x[rows + (idx,)] if x is not None else None for x in (P, T)))  # [b, H, C]
            loss = F.cross_entropy(logits.reshape(-1, classes), Y[idx].repeat_interleave(n_heads),
                                   weight=weight, reduction="mean") * n_heads
            opt.zero_grad()
            loss.backward()
            opt.step()
    return HeadGrid(model, dev, n_enc)


@torch.no_grad()
def prepared(model: ScaledHeads, rows_of, n: int, axis: int, chunk: int = 256) -> tuple:
    """`model.prepare` (the scalers and the heads' norm) of every training row once, not every
    batch: `rows_of(part)` gives `chunk` rows at a time (stacked along `axis`), so no float32 copy
    of all the raw features is made. Each row comes out as it would in a batch."""
    parts = [model.prepare(*rows_of(slice(i, i + chunk))) for i in range(0, n, chunk)]
    return tuple(None if part[0] is None else torch.cat(part, axis) for part in zip(*parts))


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
    where it was saved behind them (fine-tuning's standardised or fitted heads),
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

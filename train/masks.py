"""Multi-block 3D masks (V-JEPA 2 style) with a fixed number of tokens per step.

Blocks are rectangles in the en-face plane (frames x columns) that span the full axial
depth. Each mask set has its own blocks, context and target. Token counts are fixed per
config (calibrated once from the block distribution), so every step has the same shapes and
XLA compiles once: unions smaller than the target count get extra blocks, and targets are
subsampled to their fixed size. The context is a fixed-size subsample of the visible cells
(unions leaving too little are handed cells back).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from train.config import MaskConfig, MaskSetConfig


@dataclasses.dataclass(frozen=True)
class Grid:
    frames: int   # T: token grid along frames (D / tubelet[0])
    depth: int    # axial rows (H / tubelet[1]); blocks span all of it
    cols: int     # columns (W / tubelet[2])

    @property
    def cells(self) -> int:
        return self.frames * self.cols

    @property
    def tokens(self) -> int:
        return self.frames * self.depth * self.cols


def grid_for(input_shape, tubelet) -> Grid:
    d, h, w = (int(s) // int(t) for s, t in zip(input_shape, tubelet))
    return Grid(d, h, w)


def sample_block(grid: Grid, cfg: MaskSetConfig, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(t0, bt, c0, bc): a block of about scale x the en-face area with aspect bt/bc in range."""
    scale = rng.uniform(*cfg.scale)
    aspect = math.exp(rng.uniform(math.log(cfg.aspect[0]), math.log(cfg.aspect[1])))
    area = scale * grid.cells
    bt = int(round(math.sqrt(area * aspect)))
    bc = int(round(math.sqrt(area / aspect)))
    # where the grid cannot hold the aspect, keep the area (the scale) and bend the aspect
    if bt > grid.frames:
        bt, bc = grid.frames, int(round(area / grid.frames))
    if bc > grid.cols:
        bc, bt = grid.cols, min(grid.frames, int(round(area / grid.cols)))
    bt, bc = min(max(bt, 1), grid.frames), min(max(bc, 1), grid.cols)
    t0 = int(rng.integers(0, grid.frames - bt + 1))
    c0 = int(rng.integers(0, grid.cols - bc + 1))
    return t0, bt, c0, bc


def _union(grid: Grid, blocks) -> np.ndarray:
    m = np.zeros((grid.frames, grid.cols), dtype=bool)
    for t0, bt, c0, bc in blocks:
        m[t0:t0 + bt, c0:c0 + bc] = True
    return m


@dataclasses.dataclass(frozen=True)
class SetSize:
    target_cells: int
    context_cells: int


def calibrate(grid: Grid, cfg: MaskConfig, seed: int = 12345) -> list[SetSize]:
    """Fixed cell counts per mask set: target = 10th percentile of the union size; context = cells
    left by the 90th percentile; at least one cell each."""
    rng = np.random.default_rng(seed)
    sizes = []
    for s in cfg.sets:
        unions = [_union(grid, [sample_block(grid, s, rng) for _ in range(s.blocks)]).sum()
                  for _ in range(cfg.calibration_samples)]
        tgt = max(1, int(np.percentile(unions, 10)))
        ctx = max(1, grid.cells - int(np.percentile(unions, 90)))
        tgt = min(tgt, grid.cells - ctx)
        if tgt < 1:
            raise ValueError(f"mask set {s}: the grid {grid} is too small for a context and a target")
        sizes.append(SetSize(tgt, ctx))
    return sizes


def _cells_to_tokens(grid: Grid, cells: np.ndarray) -> np.ndarray:
    """En-face cell ids (t * cols + c) -> token ids over the full depth, sorted."""
    t, c = np.divmod(cells, grid.cols)
    h = np.arange(grid.depth)
    tok = (t[:, None] * grid.depth + h[None, :]) * grid.cols + c[:, None]
    return np.sort(tok.reshape(-1))


def sample_masks(grid: Grid, cfg: MaskConfig, sizes: list[SetSize], rng: np.random.Generator):
    """For each mask set: (context token ids, target token ids, blocks), fixed lengths, every id a
    real token."""
    out = []
    for s, size in zip(cfg.sets, sizes, strict=True):
        blocks = [sample_block(grid, s, rng) for _ in range(s.blocks)]
        union = _union(grid, blocks)
        while union.sum() < size.target_cells:
            blocks.append(sample_block(grid, s, rng))
            union = _union(grid, blocks)
        masked = np.flatnonzero(union.reshape(-1))
        free = np.flatnonzero(~union.reshape(-1))
        excess = size.context_cells - len(free)
        if excess > 0:  # too little context: hand some masked cells back
            back = rng.choice(masked, size=excess, replace=False)
            masked, free = np.setdiff1d(masked, back), np.union1d(free, back)
        tgt = rng.choice(masked, size=size.target_cells, replace=False)
        ctx = rng.choice(free, size=size.context_cells, replace=False)
        out.append((_cells_to_tokens(grid, ctx), _cells_to_tokens(grid, tgt), blocks))
    return out

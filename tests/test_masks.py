import numpy as np
import pytest

from train import masks as M
from train.config import MaskConfig, MaskSetConfig


@pytest.mark.parametrize("shape,tubelet", [((32, 96, 96), (4, 16, 16)), ((64, 384, 384), (4, 16, 16))])
def test_mask_invariants(shape, tubelet):
    grid = M.grid_for(shape, tubelet)
    cfg = MaskConfig()
    sizes = M.calibrate(grid, cfg, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        sets = M.sample_masks(grid, cfg, sizes, rng)
        assert len(sets) == 2
        for (ctx, tgt, blocks), size, set_cfg in zip(sets, sizes, cfg.sets):
            assert len(ctx) == size.context_cells * grid.depth and len(tgt) == size.target_cells * grid.depth
            assert len(np.intersect1d(ctx, tgt)) == 0
            assert ctx.min() >= 0 and tgt.max() < grid.tokens
            assert len(np.unique(ctx)) == len(ctx) and len(np.unique(tgt)) == len(tgt)
            # each block spans the full axial depth: targets come in whole depth columns
            t, rest = np.divmod(tgt, grid.depth * grid.cols)
            h, c = np.divmod(rest, grid.cols)
            cells = t * grid.cols + c
            assert all(np.sum(cells == u) == grid.depth for u in np.unique(cells))
            for t0, bt, c0, bc in blocks:
                frac = bt * bc / grid.cells
                lo, hi = set_cfg.scale
                # rounding to whole tokens: within one row or column of the configured area
                slack = (bt + bc + 1) / grid.cells
                assert lo - slack <= frac <= hi + slack, (frac, set_cfg.scale)


def test_block_aspect_respected_on_large_grid():
    grid = M.Grid(frames=64, depth=1, cols=64)
    s = MaskSetConfig(blocks=1, scale=(0.15, 0.15), aspect=(0.75, 1.5))
    rng = np.random.default_rng(1)
    for _ in range(200):
        t0, bt, c0, bc = M.sample_block(grid, s, rng)
        assert 0.75 * 0.85 <= bt / bc <= 1.5 * 1.15
        assert 0 <= t0 and t0 + bt <= 64 and 0 <= c0 and c0 + bc <= 64


def test_masks_are_reproducible_from_the_seed():
    grid = M.grid_for((32, 96, 96), (4, 16, 16))
    cfg = MaskConfig()
    sizes = M.calibrate(grid, cfg)
    a = M.sample_masks(grid, cfg, sizes, np.random.default_rng([0, 3, 7]))
    b = M.sample_masks(grid, cfg, sizes, np.random.default_rng([0, 3, 7]))
    for (c1, t1, _), (c2, t2, _) in zip(a, b):
        assert (c1 == c2).all() and (t1 == t2).all()

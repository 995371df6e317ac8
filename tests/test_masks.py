import numpy as np
import pytest

from octfm.config import ConfigError
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




def test_conv_stem_keeps_the_token_grid_and_rejects_indivisible_tubelets():
    """model.stem: the convolutions halve rows and columns and the patchify takes the rest of
    the tubelet, so the grid (and every mask) is the plain ViT's; a tubelet the strides do not
    divide is refused, naming the keys."""
    import torch

    from train.config import ModelConfig
    from train.model import Encoder

    plain = ModelConfig(tubelet=(4, 16, 16), stem=(), stem_pool="none", dim=32, depth=1, heads=2)
    stem = ModelConfig(tubelet=(4, 16, 16), stem=(8, 16), dim=32, depth=1, heads=2)
    x = torch.randn(2, 1, 16, 48, 48)
    a, b = Encoder(plain, (16, 48, 48)), Encoder(stem, (16, 48, 48))
    assert a.grid == b.grid and b(x).shape == a(x).shape == (2, 4 * 3 * 3, 32)
    assert b.patch.kernel_size == (4, 4, 4)
    with pytest.raises(ConfigError, match="model.tubelet .* model.stem"):
        Encoder(ModelConfig(tubelet=(4, 6, 6), stem=(8, 8), dim=32, depth=1, heads=2), (16, 48, 48))



@pytest.mark.parametrize("stem,stem_pool", [((), "none"), ((8,), "max")])
def test_patchify_as_a_matmul_is_the_convolution(stem, stem_pool):
    """tokenize lays tubelets out as rows and multiplies (train/model.py patchify): the tokens
    and the gradients of the patch and peak weights equal the Conv3d modules' own, in the
    grid's token order, so the weights keep the Conv3d layout."""
    import torch
    import torch.nn.functional as F

    from train.config import ModelConfig
    from train.model import Encoder

    torch.manual_seed(0)
    enc = Encoder(ModelConfig(tubelet=(4, 16, 16), stem=stem, stem_pool=stem_pool, dim=32, depth=1, heads=2), (8, 32, 48))
    x = torch.randn(2, 1, 8, 32, 48)

    def by_conv():
        s = enc.stem(x)
        t = enc.patch(s)
        if enc.peak is not None:
            t = t + enc.peak(F.max_pool3d(s, enc.patch.kernel_size))
        return t.flatten(2).transpose(1, 2) + enc.pos

    weights = [enc.patch.weight, enc.patch.bias] + ([enc.peak.weight] if enc.peak is not None else [])
    grads = []
    for fn in (by_conv, lambda: enc.tokenize(x)):
        out = fn()
        grads.append(torch.autograd.grad(out.square().sum(), weights))
        grads[-1] = (out.detach(),) + grads[-1]
    for a, b in zip(*grads):
        assert a.shape == b.shape and float((a - b).norm() / b.norm()) <= 1e-5  # float32 sums in another order

def test_peak_pooled_tokens_read_a_small_lesion_alike_anywhere_in_its_tubelet():
    """model.stem_pool=max: a bright voxel at two places inside one tubelet gives that token the
    same peak features (the patchify's position-dependent weights zeroed to isolate them), while
    the plain patchify tells the two places apart."""
    import torch

    from train.config import ModelConfig
    from train.model import Encoder

    def token(enc, where=None):
        x = torch.zeros(1, 1, 8, 32, 32)
        if where:
            x[(0, 0, *where)] = 5.0
        return enc.tokenize(x)[0, 0]

    torch.manual_seed(0)
    peak = Encoder(ModelConfig(tubelet=(4, 16, 16), stem=(8,), stem_pool="max", dim=16, depth=1, heads=2), (8, 32, 32))
    plain = Encoder(ModelConfig(tubelet=(4, 16, 16), stem=(8,), stem_pool="none", dim=16, depth=1, heads=2), (8, 32, 32))
    assert not torch.allclose(token(plain, (1, 4, 4)), token(plain, (2, 8, 10)))
    with torch.no_grad():
        peak.patch.weight.zero_()
    a, b = token(peak, (1, 4, 4)), token(peak, (2, 8, 10))
    assert torch.allclose(a, b, atol=1e-6) and not torch.allclose(a, token(peak), atol=1e-3)  # the dot is seen


def test_max_pooling_reaches_every_reader_and_survives_export():
    """model.pool=max: the pooled vector and the attentive probe's coarse tokens are maxima over
    tokens, and a model folder's config.json rebuilds the same pooling (a mean would dilute a cue
    held by one token of many)."""
    import torch

    from octfm import config
    from train import encoder as public
    from train.config import ModelConfig
    from train.model import Encoder

    arch = {"tubelet": [4, 16, 16], "stem": [8], "stem_pool": "max", "pool": "max", "dim": 16, "depth": 1,
            "heads": 2, "mlp_ratio": 4.0}
    torch.manual_seed(0)
    enc = Encoder(config.from_dict(ModelConfig, arch), (8, 32, 64))
    h = torch.randn(2, enc.num_tokens, 16)
    assert torch.equal(enc.pool(h), h.amax(1)) and not torch.allclose(enc.pool(h), h.mean(1))
    coarse = enc.pool_grid(h, (1, 2, 2))  # grid 2 x 2 x 4 -> 2 x 1 x 2
    assert coarse.shape == (2, 4, 16) and torch.equal(coarse[:, 0], h[:, [0, 1, 4, 5]].amax(1))
    folder = public.build({"architecture": arch, "input": {"stride": [1, 1, 1], "input_shape": [8, 32, 64]},
                           "normalization": {"mean": 0.5, "std": 0.25}}, enc.state_dict())
    out = folder(torch.randint(0, 255, (2, 8, 32, 64), dtype=torch.uint8))
    assert torch.equal(out.pooled, out.tokens.amax(1))


def test_one_tokenisation_per_step_gives_the_per_mask_set_loss_and_gradients():
    """JEPA tokenises the volume once and gathers each mask set's context from it: the loss and
    every gradient equal those of a full encoder pass per mask set (the way before)."""
    import torch

    from train.config import LossConfig, ModelConfig
    from train.model import JEPA, gather_tokens

    torch.manual_seed(0)
    cfg = ModelConfig(tubelet=(4, 16, 16), stem=(8,), stem_pool="max", dim=32, depth=2, heads=2, pred_dim=16,
                      pred_depth=1, pred_heads=2)
    model = JEPA(cfg, (8, 32, 64), LossConfig(local=1.0))
    x, targets = torch.randn(2, 1, 8, 32, 64), torch.randn(2, 16, 32)
    masks = [(torch.tensor([[0, 3, 14, 15]] * 2), torch.tensor([[1, 2]] * 2)),
             (torch.tensor([[4, 5, 6]] * 2), torch.tensor([[7, 8, 9]] * 2))]

    def per_mask_set():  # the reference: tokenise inside each encoder pass
        from train.model import local_cells
        cells, losses = local_cells(x, model.tubelet, model.loss.local_cell), []
        for ctx_idx, tgt_idx in masks:
            h = model.encoder(x, ctx_idx)
            latent = (model.predictor(h, ctx_idx, tgt_idx) - gather_tokens(targets, tgt_idx)).abs().mean()
            losses.append(latent + (model.local_head(h) - gather_tokens(cells, ctx_idx)).abs().mean())
        return torch.stack(losses).mean()

    grads = []
    for fn in (lambda: model(x, masks, targets), per_mask_set):
        model.zero_grad()
        loss = fn()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_local_term_reads_each_context_token_own_tubelet_cells():
    """loss.local: a bright voxel and a dark one shift the mean of the cell where they sit, in the
    token whose tubelet holds them (the patchify's order), by their value / cell voxels; the term
    adds a head and a gradient to the encoder, and a cell that does not divide the tubelet is
    refused."""
    import torch

    from train.config import LossConfig, ModelConfig
    from train.model import JEPA, gather_tokens, local_cells

    x = torch.zeros(1, 1, 8, 32, 64)            # grid 2 x 2 x 4 of 4 x 16 x 16 tubelets
    x[0, 0, 5, 20, 37] = 3.2                    # token (1, 1, 2) = 1*8 + 1*4 + 2 = 14; cell (0, 1, 1) of 2 x 4 x 4 voxels
    x[0, 0, 2, 3, 60] = -1.6                    # token (0, 0, 3) = 3; cell (1, 0, 3)
    cells = local_cells(x, (4, 16, 16), (2, 4, 4))
    assert cells.shape == (1, 16, 32)
    assert cells[0, 14].reshape(2, 4, 4)[0, 1, 1] == 3.2 / 32 and cells[0, 3].reshape(2, 4, 4)[1, 0, 3] == -1.6 / 32
    assert torch.count_nonzero(cells) == 2

    cfg = ModelConfig(tubelet=(4, 16, 16), dim=16, depth=1, heads=2, pred_dim=8, pred_depth=1, pred_heads=2)
    torch.manual_seed(0)
    plain, local = JEPA(cfg, (8, 32, 64), LossConfig(local=0.0)), JEPA(cfg, (8, 32, 64), LossConfig())
    assert plain.local_head is None and local.local_head.out_features == 32
    ctx, tgt = torch.tensor([[0, 3, 14, 15]]), torch.tensor([[1, 2]])
    targets = torch.zeros(1, 16, 16)
    loss = local(x, [(ctx, tgt)], targets)
    loss.backward()
    assert local.local_head.weight.grad.abs().sum() > 0
    # the term is the head's L1 on the context tokens' own cells, on top of the latent loss
    with torch.no_grad():
        h = local.encoder(x, ctx)
        latent = (local.predictor(h, ctx, tgt) - gather_tokens(targets, tgt)).abs().mean()
        term = (local.local_head(h) - gather_tokens(cells, ctx)).abs().mean()
    assert torch.allclose(loss, latent + term, atol=1e-6)
    with pytest.raises(ConfigError, match="loss.local_cell"):
        JEPA(cfg, (8, 32, 64), LossConfig(local_cell=(3, 4, 4)))


def test_the_objective_is_named_by_its_terms_and_a_negative_weight_is_refused():
    """objective(): a run with the local term is not called plain V-JEPA; a negative weight is
    refused, naming the key."""
    from train.config import LossConfig
    from train.model import objective

    assert objective(LossConfig()) == (
        "V-JEPA latent prediction + local intensity term (tubelet mean cells), weights 1 / 1")
    assert objective(LossConfig(local=0.5)) == (
        "V-JEPA latent prediction + local intensity term (tubelet mean cells), weights 1 / 0.5")
    assert objective(LossConfig(local=0.0)) == "V-JEPA latent prediction"
    with pytest.raises(ConfigError, match="local"):
        LossConfig(local=-1.0)


def test_the_xla_sharding_covers_every_batch_tensor(tiny_cache, tmp_path):
    """The SPMD input sharding is read off a dataset item, so every tensor a batch holds is in it (a
    hand-kept key list misses a key that a new batch tensor adds)."""
    from conftest import tiny_train_args

    from octfm import config
    from train import data, masks, runtime
    from train.config import TrainConfig

    cfg = config.load(TrainConfig, "configs/pretrain_smoke.yaml",
                      tiny_train_args(tiny_cache, tmp_path))
    grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
    rows = data.select_rows(cfg.data.cache, ["train"], None)
    ds = data.CacheDataset(rows, cfg.data, cfg.mask, grid, masks.calibrate(grid, cfg.mask), 0)
    ranks = runtime.batch_ranks(ds[(0, 0)])
    n = len(cfg.mask.sets)
    assert ranks == {"x": 5, "aug": 2, **{f"{k}_{i}": 2 for i in range(n) for k in ("ctx", "tgt")}}

"""The training crop: `data.scale` cuts a random box of a fraction of the
crop and resizes it back, so a cache stored at the crop's own size (production: 64 x 384 x 384)
still sees scale and position jitter (the recipe: [0.8, 1]); [1, 1] is the plain random crop."""
import pytest
import torch
from conftest import tiny_train_args

from octfm import config
from octfm.config import ConfigError
from train import data, masks
from train.config import TrainConfig

SMOKE = "configs/pretrain_smoke.yaml"


def dataset(cache, tmp_path, **extra) -> data.CacheDataset:
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(cache, tmp_path, **extra))
    grid = masks.grid_for(cfg.data.input_shape, cfg.model.tubelet)
    rows = data.select_rows(cfg.data.cache, ["train"], None)
    return data.CacheDataset(rows, cfg.data, cfg.mask, grid, masks.calibrate(grid, cfg.mask), 0)


def test_a_scale_of_one_is_the_plain_random_crop(tiny_cache, tmp_path):
    """[1, 1] gives, bit for bit, the plain random crop (rebuilt here: MONAI's random crop then the
    flip, seeded from the sample's generator)."""
    from monai.transforms import Compose, RandFlip, RandSpatialCrop

    from cache import store

    ds = dataset(tiny_cache, tmp_path, **{"data.scale": "[1.0,1.0]"})
    for key in [(0, 0), (1, 3), (2, 5)]:
        before = Compose([RandSpatialCrop(tuple(ds.cfg.input_shape), random_size=False),
                          RandFlip(prob=ds.cfg.flip_prob, spatial_axis=2)])
        before.set_random_state(seed=int(data.sample_rng(0, *key).integers(2 ** 31)))
        vol = store.read_volume(ds.cfg.cache, ds.rows[key[1]]["volume"])[None]
        assert torch.equal(ds[key]["x"], torch.as_tensor(before(vol)).to(torch.uint8))


def test_a_scale_below_one_zooms_a_random_box_back_to_the_crop(tiny_cache, tmp_path):
    plain = dataset(tiny_cache, tmp_path, **{"data.flip_prob": 0.0, "data.scale": "[1.0,1.0]"})
    zoom = dataset(tiny_cache, tmp_path, **{"data.flip_prob": 0.0, "data.scale": "[0.5,0.8]"})
    changed = 0
    for key in [(0, 0), (0, 1), (1, 2)]:
        a, b = plain[key]["x"], zoom[key]["x"]
        assert b.shape == a.shape == (1, *plain.cfg.input_shape) and b.dtype == torch.uint8
        changed += not torch.equal(a, b)
        assert torch.equal(b, zoom[key]["x"])              # the same key: the same box (resumable, worker-free)
    assert changed == 3
    assert not torch.equal(zoom[(0, 0)]["x"], zoom[(1, 0)]["x"])  # another epoch: another box


@pytest.mark.parametrize("bad", ["[0.9,0.8]", "[0.0,1.0]", "[0.5,1.5]"])
def test_a_bad_scale_is_refused_by_its_key(bad, tiny_cache, tmp_path):
    with pytest.raises(ConfigError, match=r"key 'data.scale'"):
        config.load(TrainConfig, SMOKE, tiny_train_args(tiny_cache, tmp_path, **{"data.scale": bad}))


def test_the_augment_bench_divides_by_the_loaders_workers_on_this_host(monkeypatch):
    """The production config leaves data.workers null (from the host's cores), and
    `make bench`'s augment suite divided by it, so it always reported "not measured"."""
    import os

    from bench import augment_bench

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(5)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    res, lines = augment_bench.run(None, quick=True)
    assert res["workers"] == 4 and res["extra_ms_per_batch_per_worker"] == pytest.approx(
        (res["ms_per_sample"]["data.scale [0.8, 1.0]"] - res["ms_per_sample"]["crop + flip"]) * res["batch_size"] / 4,
        abs=0.1 * res["batch_size"] / 4 + 0.05)  # the ms per sample rounded to 0.1
    assert "data.workers=4" in lines[-1]

"""The learning check's supervised reference (evals/supervised.py) takes the config's loader
workers: the GPU size ships `data.workers: null`. Its CUDA run is in tests/test_cuda.py."""
from conftest import tiny_train_args
from evals import supervised
from octfm import config
from train import checkpoint
from train.config import TrainConfig

SMOKE = "configs/pretrain_smoke.yaml"


def supervised_cfg(tiny_cache, tmp_path, *extra):
    args = [a for a in tiny_train_args(tiny_cache, tmp_path / "runs") if not a.startswith("data.workers=")]
    return config.load(TrainConfig, SMOKE, [*args, "data.workers=null", *extra])


def test_workers_null_means_the_default_loader_workers(tiny_cache, tmp_path):
    """data.workers: null is `data.loader_workers` (the cores less one), as in pretraining; it
    used to be compared with 0 and raised a TypeError at the GPU size's first reference."""
    cfg = supervised_cfg(tiny_cache, tmp_path, "device=cpu", "precision=fp32")
    assert cfg.data.workers is None
    path = supervised.train(cfg, "diabetic", str(tmp_path / "ckpt"), steps=2, progress=False)
    st = checkpoint.load(path)
    assert st["step"] == 2 and st["supervised"]["task"] == "diabetic"


def test_a_label_fraction_smaller_than_a_batch_trains_on_what_it_has(tiny_cache, tmp_path):
    """A small cohort's 25% or 10% of labels can hold fewer rows than batch_size (the GPU size's
    smoke run: about 50 rows at batch 128); the reference takes them all as its batch instead of
    stopping the check with a DataError after pretraining."""
    cfg = supervised_cfg(tiny_cache, tmp_path, "device=cpu", "precision=fp32", "data.workers=0")
    rows = supervised.task_rows(cfg)
    one = {rows[0]["participant_id"]}
    n = sum(r["participant_id"] in one for r in rows)
    assert 0 < n < cfg.batch_size
    path = supervised.train(cfg, "diabetic", str(tmp_path / "ckpt"), steps=10, progress=False, participants=one)
    assert checkpoint.load(path)["step"] == 10  # 10 steps: OneCycleLR's one-step warmup divided by zero

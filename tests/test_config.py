import dataclasses

import pytest

from octfm import config
from cache.config import CacheConfig


@dataclasses.dataclass
class Inner:
    lr: float = 1e-3
    ckpt_dir: str | None = "runs"


@dataclasses.dataclass
class Outer:
    optim: Inner = dataclasses.field(default_factory=Inner)
    steps: int = 10


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(config.ConfigError, match=r"unknown key 'optim.lrr'") as e:
        config.load(Outer, p)
    assert str(p) in str(e.value)


def test_null_stays_none_and_overrides_are_typed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  ckpt_dir: null\n")
    cfg = config.load(Outer, p, ["optim.lr=3e-4", "steps=50"])
    assert cfg.optim.ckpt_dir is None and cfg.optim.lr == pytest.approx(3e-4) and cfg.steps == 50


def test_wrong_type_names_key():
    with pytest.raises(config.ConfigError, match=r"'steps'.*integer"):
        config.from_dict(Outer, {"steps": "many"})


def test_cache_config_file_loads_and_round_trips():
    cfg = config.load(CacheConfig, "configs/cache.yaml")
    assert tuple(cfg.preprocess.target_shape) == (64, 384, 384)
    again = config.from_dict(CacheConfig, config.to_dict(cfg))
    assert again == cfg

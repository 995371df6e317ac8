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


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("check_name", ["pretrain_check", "pretrain_check_gpu"])
def test_check_recipe_is_the_production_recipe_at_check_size(check_name):
    """configs/pretrain_check.yaml (and its GPU size, pretrain_check_gpu.yaml) differs from
    configs/pretrain_multi_domain.yaml only in the keys its header lists (size and run settings):
    what the learning check proves is what users run."""
    from octfm import config
    from train.config import TrainConfig

    def load(name):
        return _flat(config.to_dict(config.load(TrainConfig, f"configs/{name}.yaml", [])))

    prod, check = load("pretrain_multi_domain"), load(check_name)
    differ = {k for k in prod.keys() | check.keys() if prod.get(k) != check.get(k)}
    listed, in_list = set(), False
    for ln in open(f"configs/{check_name}.yaml"):             # the header's "size:" and "run:" lists
        if not ln.startswith("#"):
            break
        body = ln[1:].strip()
        if body.startswith(("size:", "run:")):
            in_list, body = True, body.split(":", 1)[1]
        elif not ln.startswith("#      "):
            in_list = False
        if in_list:
            listed.update(body.split())
    assert "model.dim" in listed and differ <= listed, f"not size or run settings: {sorted(differ - listed)}"
    single = load("pretrain_single_domain")
    assert {k for k in prod if prod[k] != single.get(k)} <= {"name", "data.devices"}


def test_shipped_configs_are_the_defaults():
    """`python -m evals.finetune` or `evals.probe` without --config runs the recipe the shipped
    YAML (what make passes) holds, not an older one left in the dataclass (the probe config
    names the smoke run, which only the make target should assume)."""
    from evals.config import FinetuneConfig, ProbeConfig

    shipped = [(FinetuneConfig, "configs/finetune.yaml", set()), (ProbeConfig, "configs/probe.yaml", {"run"})]
    for cls, path, own in shipped:
        yaml_cfg, default = config.to_dict(config.load(cls, path)), config.to_dict(config.load(cls, None))
        drop = lambda d: {k: v for k, v in d.items() if k not in own}  # noqa: E731
        assert drop(yaml_cfg) == drop(default), path


def test_the_production_cache_is_set_per_machine_by_one_variable():
    """The production configs read the folder `make stage` fills by default (its LOCAL), and
    `make pretrain LOCAL=<disk>` points a run at a cache staged elsewhere (the TPU VM's read-only
    disk, a GPU node's NVMe): one variable for both recipes, no machine's path baked in."""
    import os
    import re
    import subprocess

    from conftest import REPO
    from train.config import TrainConfig

    default = re.search(r"^LOCAL\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    for name in ("pretrain_multi_domain", "pretrain_single_domain"):
        assert config.load(TrainConfig, REPO / "configs" / f"{name}.yaml").data.cache == default
    cmd = ["make", "-n", "-s", "pretrain", "CONFIG=configs/pretrain_multi_domain.yaml"]
    with_local = subprocess.run([*cmd, "LOCAL=/mnt/nvme/octfm-cache", "ARGS=max_steps=5"], cwd=REPO,
                                capture_output=True, text=True, timeout=60).stdout.splitlines()[-1]
    assert with_local.endswith("data.cache=/mnt/nvme/octfm-cache max_steps=5")  # ARGS still have the last word
    plain = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "LOCAL"}).stdout.splitlines()[-1]
    assert "train.pretrain" in plain and "data.cache" not in plain

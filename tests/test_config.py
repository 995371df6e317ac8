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


PRETRAIN = ["pretrain_smoke", "pretrain_check", "pretrain_check_gpu", "pretrain_multi_domain", "pretrain_single_domain"]
# What a pretraining config may set: its size (optim.ema with it: a short run needs a faster target)
# and where and how it runs. Never the recipe's own keys (the architecture's kinds, the loss, the
# masks, the augmentation, the optimiser's settings): train/config.py's defaults carry them.
SIZE_KEYS = {"global_batch", "chip_batch", "max_steps", "data.input_shape", "model.dim", "model.depth", "model.heads", "model.pred_dim",
             "model.pred_depth", "model.pred_heads", "optim.lr", "optim.start_lr", "optim.final_lr",
             "optim.warmup_steps", "optim.ema"}
RUN_KEYS = {"name", "device", "precision", "log_every", "val_every", "val_batches", "eval_every", "ckpt_every",
            "keep_last", "data.cache", "data.stride", "data.workers", "data.scanners", "wandb.enabled"}


@pytest.mark.parametrize("name", PRETRAIN)
def test_pretrain_configs_state_only_their_size_and_run_keys_off_the_defaults(name):
    """The defaults are the recipe (docs/recipe.md): each config sets only size and run keys, each
    at a value other than its default (a restated default would hide a later change of the recipe),
    so the demo, the learning check and production train the one recipe at their sizes."""
    import yaml

    from train.config import TrainConfig

    raw = _flat(yaml.safe_load(open(f"configs/{name}.yaml")))
    loaded = _flat(config.to_dict(config.load(TrainConfig, f"configs/{name}.yaml")))
    default = _flat(config.to_dict(TrainConfig()))
    assert set(raw) <= SIZE_KEYS | RUN_KEYS, f"recipe keys set: {sorted(set(raw) - SIZE_KEYS - RUN_KEYS)}"
    assert [k for k in raw if loaded[k] == default[k]] == [], "keys set at their default"
    if name == "pretrain_single_domain":
        prod = _flat(config.to_dict(config.load(TrainConfig, "configs/pretrain_multi_domain.yaml")))
        assert {k for k in prod if prod[k] != loaded[k]} == {"name", "data.scanners"}


@pytest.mark.parametrize("override", ["mask.repeats=2", "loss.context=1", "loss.local_stat=mean"])
def test_a_removed_key_is_refused_by_name(override):
    """Keys of modes the recipe left (docs/history/learning-check.md) are gone, not ignored."""
    from train.config import TrainConfig

    key = override.split("=")[0]
    with pytest.raises(config.ConfigError, match=rf"unknown key '{key}'"):
        config.load(TrainConfig, "configs/pretrain_smoke.yaml", [override])


def test_a_checkpoint_or_model_folder_from_before_the_cut_is_refused_naming_the_tag(tmp_path):
    """A saved config whose keys differ from today's (older code wrote it) is refused with the tag
    whose code reads it, never filled in with today's defaults (another encoder than its weights')."""
    import copy
    import json

    from evals import features
    from train import encoder
    from train.config import TrainConfig, saved_config

    now = config.to_dict(config.load(TrainConfig, "configs/pretrain_check.yaml"))
    assert saved_config(now, "new.pt") == config.load(TrainConfig, "configs/pretrain_check.yaml")
    old = copy.deepcopy(now)
    old["mask"]["repeats"] = 1
    old["loss"].update(context=0.0, local_stat="mean")
    with pytest.raises(config.ConfigError, match=r"^old\.pt: a checkpoint \(its config has loss\.context, loss\.local_stat, "
                                                 r"mask\.repeats\) from before octfm's v1 cut; .*\(git checkout results-2026-12\)$"):
        features.checkpoint_encoder("old.pt", state={"config": old, "target": {}, "step": 0})
    older = copy.deepcopy(now)
    del older["model"]["stem"], older["model"]["stem_pool"]
    with pytest.raises(config.ConfigError, match=r"older\.pt: a checkpoint \(lacks model\.stem, model\.stem_pool\) from before.*results-2026-12"):
        saved_config(older, "older.pt")
    folder = tmp_path / "model"
    folder.mkdir()
    arch = {k: v for k, v in now["model"].items() if k in encoder.ARCH_KEYS and k != "pool"}
    (folder / encoder.CONFIG_FILE).write_text(json.dumps(
        {"format": encoder.FORMAT, "format_version": encoder.FORMAT_VERSION, "architecture": arch}))
    with pytest.raises(config.ConfigError, match=r"config\.json: a model folder \(its architecture lacks pool\) from before .*results-2026-12"):
        encoder.read_config(folder)


def test_a_checkpoint_holding_a_removed_research_setting_loads_at_the_value_the_trainer_runs():
    """mask.context and loss.latent left the trainer (each ran one value in every recipe): a checkpoint
    that saved them at that value loads as before; one trained with another value is refused, naming it."""
    import copy

    from train.config import RETIRED, TrainConfig, saved_config

    now = config.to_dict(config.load(TrainConfig, "configs/pretrain_check.yaml"))
    saved = copy.deepcopy(now)
    saved["mask"]["context"], saved["loss"]["latent"] = "trimmed", 1.0   # what every earlier checkpoint holds
    assert RETIRED == {"mask.context": "trimmed", "loss.latent": 1.0}
    assert saved_config(saved, "before.pt") == saved_config(now, "now.pt")
    assert saved["mask"]["context"] == "trimmed"                         # the caller's dict is left as it was
    for path, value in (("mask.context", "padded"), ("loss.latent", 0.0)):
        other = copy.deepcopy(saved)
        other[path.split(".")[0]][path.split(".")[1]] = value
        with pytest.raises(config.ConfigError, match=rf"other\.pt: a checkpoint trained with {path}={value!r}"):
            saved_config(other, "other.pt")


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


def test_a_renamed_key_is_read_for_one_release_with_a_message(capsys, tmp_path):
    """Scanners are scanners (data.scanners, select.scanner, per_scanner, cross_scanner) and accelerators are
    `device`: the old keys are still read, each with a message naming both names; both at once is refused."""
    from evals.config import ProbeConfig
    from train.config import TrainConfig, saved_config

    cfg = config.load(TrainConfig, "configs/pretrain_smoke.yaml", ["data.devices=[zeiss_cirrus]"])
    assert cfg.data.scanners == ["zeiss_cirrus"]
    assert "key 'data.devices' is now 'data.scanners'" in capsys.readouterr().err
    assert config.load(CacheConfig, None, ["select.device=[zeiss_cirrus]"]).select.scanner == ["zeiss_cirrus"]
    probe = config.load(ProbeConfig, None, ["per_device=false", "cross_device=false"])
    assert not probe.per_scanner and not probe.cross_scanner
    assert "'per_device' is now 'per_scanner'" in capsys.readouterr().err
    with pytest.raises(config.ConfigError, match="both 'data.devices' and 'data.scanners'"):
        config.load(TrainConfig, None, ["data.devices=[a]", "data.scanners=[a]"])
    # a checkpoint saved under the old name loads as it was trained
    saved = config.to_dict(TrainConfig())
    del saved["data"]["scanners"]
    saved["data"]["devices"] = ["zeiss_cirrus"]
    assert saved_config(saved, "x.pt").data.scanners == ["zeiss_cirrus"]

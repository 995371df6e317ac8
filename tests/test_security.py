"""Secrets stay out of what we write, and config files cannot run code."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli, s3_env, tiny_train_args, upload_tree

SMOKE = "configs/pretrain_smoke.yaml"
KEY_ID = "AKIAOCTFMSENTINELKEY7"
SECRET = "octfm-secret-SENTINEL-9f3a1c77e0"
WANDB_KEY = "0123456789abcdef0123456789abcdefSENTINEL"


def _files_containing(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            hits += [f"{p}: {n}" for n in needles if n.encode() in data]
    return hits


@pytest.mark.slow  # about 26 s on 2 cores (make test over its time): the heavy lane, which CI runs
def test_credentials_never_reach_logs_manifests_or_run_files(synth_tree, s3_server, tiny_cache, tmp_path, no_ca_bundle):
    upload_tree(s3_server, "secret-bucket", synth_tree)
    # W&B's own data, cache and config folders go under tmp_path too, so the scan below sees them
    env = {**s3_env(s3_server, KEY_ID, SECRET), "WANDB_API_KEY": WANDB_KEY,
           **{f"WANDB_{k}_DIR": str(tmp_path / f"wandb_{k.lower()}") for k in ("DATA", "CACHE", "CONFIG")}}
    needles = [KEY_ID, SECRET, WANDB_KEY]
    dst, cache, runs = tmp_path / "gcs", tmp_path / "cache", tmp_path / "runs"
    outputs = [
        run_cli("ingest.mirror", "--src", "b2:secret-bucket/dataset", "--dst", str(dst), "--no-progress", env=env),
        # a failing command prints errors too: a bucket that does not exist
        run_cli("ingest.mirror", "--src", "b2:no-such-bucket/x", "--dst", str(tmp_path / "none"), "--no-progress",
                "--retries", "1", "--low-level-retries", "1", env=env),
        run_cli("manifests.build", "--source", str(dst), "--out", str(cache / "sources.parquet"), env=env),
        run_cli("cache.build", "--source", str(dst), "--cache", str(cache), "--no-progress",
                "preprocess.target_shape=[8,32,32]", env=env),
        run_cli("train.pretrain", "--config", SMOKE, "--no-progress", env=env,
                *tiny_train_args(tiny_cache, runs, name="s", max_steps=2, ckpt_every=2,
                                 **{"wandb.enabled": "true", "wandb.mode": "offline"})),
    ]
    assert [r.returncode for r in outputs] == [0, 1, 0, 0, 0], [r.stderr[-1500:] for r in outputs]
    assert (runs / "s" / "wandb").is_dir() and (dst / "octfm_mirror.parquet").exists()
    for r in outputs:
        for n in needles:
            assert n not in r.stdout and n not in r.stderr, (r.args, n)
    assert _files_containing(tmp_path, needles) == []


def test_yaml_cannot_construct_python_objects(tmp_path):
    marker = tmp_path / "pwned"
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(f"workers: !!python/object/apply:os.system ['touch {marker}']\n")
    r = run_cli("cache.build", "--source", str(tmp_path), "--cache", str(tmp_path / "c"), "--config", str(cfg))
    assert r.returncode == 2, r.stderr
    assert str(cfg) in r.stderr and not marker.exists()

"""Shared fixtures: synthetic datasets, and real servers (GCS emulator, S3) on loopback."""
from __future__ import annotations

import octfm  # noqa: F401  (sets gcsfs environment before gcsfs is imported)

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ingest import synth

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMALL = ["preprocess.target_shape=[16,48,48]"]  # a small grid keeps tests fast


def run_cli(module: str, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a stage entry as a user would (python -m ...), capturing output and status."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start a server whose output goes to a file (a pipe nobody reads would fill and block it)."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"server on port {port} did not start: {log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def synth_tree(tmp_path_factory) -> Path:
    """The default synthetic AI-READI tree (with its bad files), generated once."""
    out = tmp_path_factory.mktemp("synth") / "dataset"
    synth.generate(out, synth.SynthConfig(participants=8, scale=8, seed=1))
    return out


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """A real GCS JSON API emulator on 127.0.0.1; yields its URL, sets the environment."""
    port = free_port()
    proc = start_server([str(BIN / "gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(port),
                         "--in-memory"], port, tmp_path_factory.mktemp("gcs") / "emulator.log")
    try:
        url = f"http://127.0.0.1:{port}"
        old = os.environ.get("STORAGE_EMULATOR_HOST")
        os.environ["STORAGE_EMULATOR_HOST"] = url
        yield url
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 (B2 speaks S3); yields its endpoint URL."""
    port = free_port()
    proc = start_server([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], port,
                        tmp_path_factory.mktemp("s3") / "moto.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def gcs_bucket(name: str):
    """Create (or reuse) a bucket on the emulator; returns a gcsfs filesystem."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"])
    if not fs.exists(name):
        fs.mkdir(name)
    fs.invalidate_cache()
    return fs


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A small cache (16 x 64 x 64 volumes) for trainer tests, built by the real build."""
    from cache import build
    from cache.config import CacheConfig
    from octfm import config

    src = tmp_path_factory.mktemp("train_src") / "dataset"
    synth.generate(src, synth.SynthConfig(participants=12, scale=16, seed=4, bad_files=False, unlabeled=0))
    cache = tmp_path_factory.mktemp("train_cache") / "cache"
    cfg = config.from_dict(CacheConfig, {"preprocess": {"target_shape": [16, 64, 64]}})
    build.build(str(src), str(cache), cfg, progress=False)
    return cache


def tiny_train_args(cache: Path, runs: Path, name: str = "t", **extra) -> list[str]:
    """Overrides for configs/pretrain_smoke.yaml that make a seconds-long CPU run."""
    args = {
        "name": name, "runs_dir": str(runs), "data.cache": str(cache), "data.stride": "[1,1,1]",
        "data.input_shape": "[16,48,48]", "data.workers": 0, "batch_size": 4, "max_steps": 6, "log_every": 1,
        "val_every": 0, "ckpt_every": 3, "model.dim": 32, "model.depth": 2, "model.heads": 2,
        "model.pred_dim": 16, "model.pred_depth": 1, "model.pred_heads": 2, "optim.warmup_steps": 2,
    }
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


@pytest.fixture(scope="session")
def tiny_run(tiny_cache, tmp_path_factory) -> Path:
    """A 4-step run on tiny_cache with validation, W&B offline (checkpoints as artifacts) and a
    small probe: the run folder `make report` and the W&B test read."""
    root = tmp_path_factory.mktemp("tiny_run")
    env = {"WANDB_API_KEY": "", **{f"WANDB_{k}_DIR": str(root / f"wandb_{k.lower()}") for k in ("DATA", "CACHE", "CONFIG")}}
    args = tiny_train_args(tiny_cache, root / "runs", name="tiny", max_steps=4, ckpt_every=2, val_every=2,
                           val_batches=1, **{"wandb.enabled": "true", "wandb.mode": "offline",
                                             "wandb.log_checkpoints": "true"})
    r = run_cli("train.pretrain", "--config", "configs/pretrain_smoke.yaml", "--no-progress", *args, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    run = root / "runs" / "tiny"
    r = run_cli("train.probe", f"run={run}", "epochs=5", "bootstrap=20", "lrs=[1e-3]", "weight_decays=[0.0]",
                "heads=[linear]", "cross_device=false")
    assert r.returncode == 0, r.stderr[-2000:]
    return run

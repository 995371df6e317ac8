"""Shared fixtures: synthetic datasets, and real servers (GCS emulator, S3) on loopback."""
from __future__ import annotations

import octfm  # noqa: F401  (sets gcsfs environment before gcsfs is imported)

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker (and so in the stages it starts), set before torch loads:
    # two workers each spinning an OpenMP pool as wide as the machine contend for its cores. On the
    # 2-core machine this took the in-process trainer and probe tests from 166 s to 94 s of wall time
    # (docs/testing.md).
    os.environ["OMP_NUM_THREADS"] = "1"
import fcntl
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

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


def run_here(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args` in this process: its main through cli.run (the same exit status, stdout and
    stderr as run_cli), for a test that runs a stage again and again. A subprocess costs about 6 s of
    imports per run on 2 cores; each command keeps a run_cli test of its own start (the entry, its exit
    status) somewhere in the light lane."""
    import contextlib
    import importlib
    import io

    from octfm import cli

    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.run(main, list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, out.getvalue(), err.getvalue())


def train_here(*args: str) -> str:
    """`make pretrain` in this process (configs/pretrain_smoke.yaml, then `args`): its stdout.
    For tests that run several short trainings and read their files: a subprocess costs about 6 s
    of imports (torch, MONAI, dynamo through the optimizer, matplotlib) per run on 2 cores."""
    import contextlib
    import io

    from train import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pretrain.main(["--config", str(REPO / "configs" / "pretrain_smoke.yaml"), "--no-progress", *args]) == 0
    return out.getvalue()


def keys_after_edits(tmp_path: Path, monkeypatch, packages, keys, edits: Sequence[str]) -> list:
    """The kept results' keys (`keys()`) over a copy of `packages`' sources, first as they are, then after
    each file of `edits` (repository paths) gets a comment appended: for tests that an edit to a file a
    result's code imports makes it afresh, and one elsewhere keeps it."""
    from octfm import config

    for package in set(packages):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(config, "REPO_ROOT", tmp_path)
    out = [keys()]
    for path in edits:
        with open(tmp_path / path, "a") as f:
            f.write("\n# an edit\n")
        out.append(keys())
    return out


def assert_same_cache(cache: Path, clean: Path, except_paths: tuple[str, ...] = ()) -> None:
    """The same manifest (timings and source URIs aside) and the same bytes in every ok volume,
    for every row but `except_paths`."""
    import numpy as np
    import pandas as pd

    from cache import store
    from manifests import schema

    def comparable(root: Path):
        df = pd.read_parquet(root / "manifest.parquet")
        df = df[~df.relpath.isin(except_paths)]
        df = df.drop(columns=[*schema.TIMING_COLUMNS, "source"]).sort_values("relpath").reset_index(drop=True)
        return df.convert_dtypes().astype(str)  # an int column read as float because of a null in a left-out row

    ref = comparable(clean)
    pd.testing.assert_frame_equal(comparable(cache), ref)
    for vol in ref.volume[ref.status == "ok"]:
        np.testing.assert_array_equal(store.read_volume(str(cache), vol), store.read_volume(str(clean), vol))


def finished_volumes(cache: Path) -> int:
    """Arrays renamed into place so far (temp dirs come and go while we look)."""
    n = 0
    for _, dirs, _ in os.walk(cache / "volumes"):
        n += sum(d.endswith(".zarr") and not d.startswith(".") for d in dirs)
    return n


def start_build(cache: Path, args: list[str], volumes: int, **popen) -> subprocess.Popen:
    """Start `python -m cache.build --cache <cache> <args>` and return once `volumes` arrays
    are in place, for a test to interrupt it; fails if the build ends first."""
    proc = subprocess.Popen([sys.executable, "-m", "cache.build", "--cache", str(cache), *args], cwd=REPO, **popen)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (cache / "sources.parquet").exists() and finished_volumes(cache) >= volumes:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the build finished before it could be interrupted; make the test data larger"
    return proc


def same_state(a: dict, b: dict) -> bool:
    """Two state dicts hold bit-identical tensors under the same keys."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_weights(a: dict, b: dict) -> bool:
    """Two checkpoints hold bit-identical context and target encoders (same keys too)."""
    return all(same_state(a[p], b[p]) for p in ("model", "target"))


def same_optimizer(a: dict, b: dict) -> bool:
    """Two checkpoints hold bit-identical optimizer states (moments and step counts), key for key."""
    import torch

    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    return sa.keys() == sb.keys() and all(
        sa[p].keys() == sb[p].keys() and all(torch.equal(sa[p][k], sb[p][k]) for k in sa[p]) for p in sa)


def guard_driver(out: Path, steps: int, spikes: dict[int, str], overrides: list[str], spike_rank: int = 0,
                 nproc: int = 1, env: dict | None = None) -> list[dict]:
    """Run tests/guard_driver.py (under torchrun when nproc > 1): `steps` updates with the loss
    multiplied by spikes[step] on process `spike_rank`; returns each process's record."""
    import torch

    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    cmd = [*launch, "tests/guard_driver.py", "--out", str(out), "--steps", str(steps), "--spike-rank", str(spike_rank),
           *[f"--spike={s}:{v}" for s, v in spikes.items()], "--", *overrides]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return [torch.load(out / f"rank{i}.pt", weights_only=True) for i in range(nproc)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int, log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start a server whose output goes to a file (a pipe nobody reads would fill and block it)."""
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
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


def built_once(request, tmp_path_factory, name: str, build) -> Path:
    """The folder `build(folder)` fills, built once per pytest session, not once per xdist worker.
    The session's shared temp folder holds it (under xdist the workers' basetemp's parent, named by
    the run's uid); the first worker to take its lock builds it and the others wait (on the 2-core
    machine each duplicate cost 8-18 s of a core). A build that dies leaves no marker, so the next
    worker starts it again from empty."""
    base, worker = tmp_path_factory.getbasetemp(), getattr(request.config, "workerinput", None)
    shared = base.parent / f"built_once_{worker['testrunuid']}" if worker else base / "built_once"
    shared.mkdir(exist_ok=True)
    folder, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def own_copy(request, tmp_path_factory, name: str, build) -> Path:
    """This worker's copy of `built_once(name)`: a test may write into it as into a folder of its own."""
    own = tmp_path_factory.mktemp(name)
    shutil.copytree(built_once(request, tmp_path_factory, name, build), own, symlinks=True, dirs_exist_ok=True)
    return own


def _build_synth_tree(folder: Path) -> None:
    synth.generate(folder / "dataset", synth.SynthConfig(participants=8, scale=8, seed=1))


@pytest.fixture(scope="session")
def synth_tree(request, tmp_path_factory) -> Path:
    """The default synthetic AI-READI tree (with its bad files), generated once."""
    return own_copy(request, tmp_path_factory, "synth", _build_synth_tree) / "dataset"


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


class RestartableGCS:
    """A GCS emulator that keeps its objects on disk, so a test can stop it (the store goes
    away mid-run) and start it again on the same port with the data still there."""

    def __init__(self, workdir: Path):
        self.workdir, self.port = workdir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = start_server([str(BIN / "gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port",
                                  str(self.port)], self.port, self.workdir / "emulator.log", cwd=self.workdir)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def restartable_gcs(tmp_path, monkeypatch):
    emu = RestartableGCS(tmp_path / "gcs_store")
    emu.workdir.mkdir()
    emu.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    try:
        yield emu
    finally:
        emu.stop()


def s3_env(endpoint: str, key_id: str = "testing", secret: str = "testing") -> dict:
    """rclone's remote `b2:` on the S3 server, defined in the environment as a user would."""
    env = {
        "RCLONE_CONFIG_B2_TYPE": "s3", "RCLONE_CONFIG_B2_PROVIDER": "Other",
        "RCLONE_CONFIG_B2_ENDPOINT": endpoint, "RCLONE_CONFIG_B2_ACCESS_KEY_ID": key_id,
        "RCLONE_CONFIG_B2_SECRET_ACCESS_KEY": secret, "RCLONE_CONFIG_B2_REGION": "us-east-1",
    }
    return env


@pytest.fixture
def no_ca_bundle(monkeypatch):
    # This machine sets AWS_CA_BUNDLE; rclone's s3 backend then fails on plain-http endpoints.
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)


def upload_tree(endpoint: str, bucket: str, root) -> int:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    n = 0
    for p in sorted(root.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), bucket, f"dataset/{p.relative_to(root).as_posix()}")
            n += 1
    return n


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MB tmpfs: a disk that fills up after a few volumes. Mounting needs root and CAP_SYS_ADMIN;
    a machine without them skips the full-disk tests, and the run's summary lists each skip with why."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"this machine cannot mount a tmpfs ({r.stderr.strip() or 'mount failed'}): "
                    "a full disk needs root with CAP_SYS_ADMIN")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


LIGHT_LANE_CHROMIUM = ("a light-lane test asked for chromium: `make test` must pass on a machine without it. "
                       "Mark the test @pytest.mark.slow (`make test-heavy` installs chromium)")


@pytest.fixture
def chromium(request) -> str:
    """Debian's chromium, for tests that render pages. Only the heavy lane may ask for it: `make test-heavy`
    installs it (`make test-deps`), while `make test` runs on fresh machines without it (`.ci/run` hides it)."""
    if request.node.get_closest_marker("slow") is None:
        pytest.fail(LIGHT_LANE_CHROMIUM)
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("chromium is missing: `make test-deps` installs Debian's chromium (as root)")
    return path


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


def _build_tiny_cache(folder: Path) -> None:
    from cache import build
    from cache.config import CacheConfig
    from octfm import config

    synth.generate(folder / "dataset",
                   synth.SynthConfig(participants=12, scale=16, seed=4, bad_files=False, unlabeled=0))
    cfg = config.from_dict(CacheConfig, {"preprocess": {"target_shape": [16, 64, 64]}})
    build.build(str(folder / "dataset"), str(folder / "cache"), cfg, progress=False)


@pytest.fixture(scope="session")
def tiny_cache(request, tmp_path_factory) -> Path:
    """A small cache (16 x 64 x 64 volumes) for trainer tests, built by the real build."""
    return own_copy(request, tmp_path_factory, "tiny_cache", _build_tiny_cache) / "cache"


def _build_signal_cache(folder: Path) -> None:
    synth.generate(folder / "ds", synth.SynthConfig(participants=60, scale=16, seed=5, bad_files=False, unlabeled=0,
                                                    signal=4.0))
    r = run_here("cache.build", "--source", str(folder / "ds"), "--cache", str(folder / "cache"), "--no-progress",
                 "preprocess.target_shape=[16,64,64]")
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="session")
def signal_cache(request, tmp_path_factory) -> Path:
    """A cache with a planted class signal (INL thickness grows with the label), 60
    participants, built by `cache.build`'s main (in this process: conftest.run_here); shared by the probe tests."""
    return own_copy(request, tmp_path_factory, "signal", _build_signal_cache) / "cache"


def _build_signal_run(cache: Path, root: Path) -> None:
    train_here(*tiny_train_args(cache, root / "runs", name="p", max_steps=2, ckpt_every=2))


@pytest.fixture(scope="session")
def signal_run(request, tmp_path_factory) -> Path:
    """A 2-step pretraining run on the planted-signal cache, built once per session and shared read-only
    (its config names the shared build of signal_cache): a test that writes into the run (a probe's
    reports, a checkpoint) copies it first."""
    cache = built_once(request, tmp_path_factory, "signal", _build_signal_cache) / "cache"
    return built_once(request, tmp_path_factory, "signal_run", lambda root: _build_signal_run(cache, root)) / "runs" / "p"


def tiny_train_args(cache: Path, runs: Path, name: str = "t", **extra) -> list[str]:
    """Overrides for configs/pretrain_smoke.yaml that make a seconds-long CPU run."""
    args = {
        "name": name, "runs_dir": str(runs), "data.cache": str(cache), "data.stride": "[1,1,1]",
        "data.input_shape": "[16,48,48]", "data.workers": 0, "global_batch": 4, "max_steps": 6, "log_every": 1,
        "val_every": 0, "ckpt_every": 3, "model.dim": 32, "model.depth": 2, "model.heads": 2,
        "model.pred_dim": 16, "model.pred_depth": 1, "model.pred_heads": 2, "optim.warmup_steps": 2,
    }
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


TINY_RUN = dict(name="tiny", max_steps=4, ckpt_every=2, val_every=2, val_batches=1, eval_every=2,
                **{"online_probe.k": 3})  # the tiny run's keys beside tiny_train_args'


def _build_wandb_run(cache: Path, root: Path) -> None:
    import importlib.util

    env = {"WANDB_API_KEY": "", **{f"WANDB_{k}_DIR": str(root / f"wandb_{k.lower()}") for k in ("DATA", "CACHE", "CONFIG")}}
    wandb = str(importlib.util.find_spec("wandb") is not None).lower()
    args = tiny_train_args(cache, root / "runs", **TINY_RUN, **{"wandb.enabled": wandb, "wandb.mode": "offline",
                                                                "wandb.log_checkpoints": "true"})
    r = run_cli("train.pretrain", "--config", "configs/pretrain_smoke.yaml", "--no-progress", *args, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.fixture(scope="session")
def wandb_run(request, tmp_path_factory) -> Path:
    """The tiny run (below) with W&B offline (checkpoints as artifacts), read-only and shared: the W&B test
    reads it. W&B starts its own service, so this run trains in a process of its own, apart from the tiny
    run the other stages read (a worker needing that one does not wait on W&B). W&B only where it is
    installed: the GPU machine's wheel folder has none."""
    cache = built_once(request, tmp_path_factory, "tiny_cache", _build_tiny_cache) / "cache"
    return built_once(request, tmp_path_factory, "wandb_run", lambda root: _build_wandb_run(cache, root)) / "runs" / "tiny"


@pytest.fixture(scope="session")
def probed_wandb_run(request, tmp_path_factory, wandb_run) -> Path:
    """wandb_run copied and probed (`make report`'s page shows both the W&B runs and the probes)."""
    def build(root: Path) -> None:
        shutil.copytree(wandb_run, root / "runs" / "tiny")
        _probe_tiny(root)

    return built_once(request, tmp_path_factory, "probed_wandb_run", build) / "runs" / "tiny"


def _probe_tiny(root: Path) -> None:
    r = run_here("evals.probe", f"run={root / 'runs' / 'tiny'}", "epochs=5", "bootstrap=20", "lrs=[1e-3]",
                 "weight_decays=[0.0]", "heads=[linear]", "cross_scanner=false")
    assert r.returncode == 0, r.stderr[-2000:]


def _build_tiny_run(cache: Path, root: Path) -> None:
    train_here(*tiny_train_args(cache, root / "runs", **TINY_RUN, **{"wandb.enabled": "false"}))
    _probe_tiny(root)


@pytest.fixture(scope="session")
def tiny_run(request, tmp_path_factory) -> Path:
    """A 4-step run on tiny_cache's volumes with validation, the online probe and a small probe, trained in
    this process: the run folder `make report`, embed, export and fine-tuning read. Read-only and shared by
    every worker, not copied: its config names the shared builds (of tiny_cache too), which stages that find
    a run from its checkpoint (embed, export) write under. A test that writes beside it passes its own
    --out. The same run with W&B: wandb_run."""
    cache = built_once(request, tmp_path_factory, "tiny_cache", _build_tiny_cache) / "cache"
    run = built_once(request, tmp_path_factory, "tiny_run", lambda root: _build_tiny_run(cache, root))
    return run / "runs" / "tiny"


def pytest_terminal_summary(terminalreporter):
    """One line per skipped test with its reason, so a run says loudly what it did not test."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.write_sep("=", f"{len(skipped)} skipped test(s), not run")
    for rep in skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        terminalreporter.write_line(f"SKIPPED {rep.nodeid}: {reason.removeprefix('Skipped: ')}")

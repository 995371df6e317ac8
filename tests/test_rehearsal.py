"""The rehearsal: README's production commands as written, against the GCS emulator, from the mirror to
the evaluation of a gs:// run. Two processes stand in for two GPU nodes (torchrun's static rendezvous on
loopback), each staging and reading only its own share; then make probe, make leaderboard, make embed and
make export take the run where its checkpoints are. If a README command changes, this test says so.

What is not as written, and why: the dataset (`b2:...`) is a generated cohort in a local folder; the bucket
is the emulator's; the NVMe folders are temporary ones; NPROC=8 is NPROC=1 (one CPU process a node) with
the node number, the node count and node 0's address ($NODE, $NODES, $MASTER) and a free MASTER_PORT set
here; the cache is built at a small shape and the production config is shrunk by overrides of model size,
crop, batch and steps only (ARGS); the probes by epochs, grid and bootstrap."""
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, gcs_bucket
from ingest import synth

BUCKET = "gs://my-gcs-bucket"
CACHE_SHRINK = "preprocess.target_shape=[16,64,64]"
MODEL_SHRINK = ("model.dim=32 model.depth=2 model.heads=2 model.pred_dim=16 model.pred_depth=1 model.pred_heads=2 "
                "data.input_shape=[16,48,48] global_batch=4 max_steps=4 ckpt_every=2 log_every=1")
PROBE_SHRINK = "epochs=5 bootstrap=50 lrs=[1e-3] weight_decays=[0.0]"


def readme_commands() -> list[str]:
    """Every command line of README's bash blocks (continuations joined, comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip())
            if line and not line.startswith("#"):
                out.append(line)
    return out


def pick(commands: list[str], start: str, *has: str) -> str:
    """The one README command that starts with `start` and holds each of `has`."""
    found = [c for c in commands if c.startswith(start) and all(h in c for h in has)]
    assert len(found) == 1, f"README: {len(found)} commands start with {start!r} and hold {has}: {found}"
    return found[0]


def with_args(cmd: str, extra: str) -> str:
    """The command with `extra` overrides added to its ARGS (or as its ARGS when it has none)."""
    if 'ARGS="' in cmd:
        return cmd.replace('ARGS="', f'ARGS="{extra} ', 1)
    return f'{cmd} ARGS="{extra}"'


def run(cmd: str, cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # about 5 minutes on 2 cores: the heavy lane
def test_readme_production_commands_run_as_written(gcs_emulator, tmp_path):
    commands = readme_commands()
    work = tmp_path / "octfm"             # a user's checkout: the Makefile, the configs, the venv
    work.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(REPO / name, work / name)   # copy2: the venv stays newer than pyproject.toml
    shutil.copytree(REPO / "configs", work / "configs")
    (work / ".venv").symlink_to(REPO / ".venv")
    source = tmp_path / "b2" / "dataset"
    synth.generate(source, synth.SynthConfig(participants=16, scale=16, seed=7, bad_files=False, unlabeled=0))
    gcs_bucket("my-gcs-bucket")
    env = {**os.environ, "WANDB_API_KEY": "", "OMP_NUM_THREADS": "1",
           **{f"WANDB_{k}_DIR": str(tmp_path / f"wandb_{k.lower()}") for k in ("DATA", "CACHE", "CONFIG")}}

    # steps 2-5: mirror, manifest, the cache in four shards, into the bucket
    run(pick(commands, "make mirror").replace("b2:my-aireadi-bucket/dataset", str(source)), work, env)
    run(with_args(pick(commands, "make manifest", "CACHE=gs://"), CACHE_SHRINK), work, env)
    shard = pick(commands, "make cache", "SHARD=0/4", f"CACHE={BUCKET}/octfm-cache")
    for i in range(4):
        run(with_args(shard.replace("SHARD=0/4", f"SHARD={i}/4"), CACHE_SHRINK), work, env)

    # step 6: the plan on both machines, as written: one recipe, its estimate
    for accel in ("ACCEL=h100 CHIPS=8", "ACCEL=tpu-v4 CHIPS=16"):
        out = run(pick(commands, "make plan", accel), work, env).stdout
        assert "global batch 128 = " in out and "ESTIMATE (assumed" in out and "chip-hours" in out

    # step 7, several nodes: each stages its share, then both train as one run writing to the bucket
    nodes = {"NODES": "2", "MASTER": "127.0.0.1"}
    stage = pick(commands, "make stage", "HOST=$NODE")
    train = pick(commands, "make pretrain", "NNODES=$NODES")
    local = [tmp_path / f"node{i}" / "octfm-cache" for i in (0, 1)]
    for i in (0, 1):
        out = run(stage.replace("/mnt/nvme/octfm-cache", str(local[i])), work, {**env, **nodes, "NODE": str(i)}).stdout
        assert f"stage: host {i} of 2:" in out and "verified" in out
    cmd = with_args(train.replace("NPROC=8", "NPROC=1"), MODEL_SHRINK) + f" MASTER_PORT={free_port()}"
    procs = [subprocess.Popen(["bash", "-c", cmd.replace("/mnt/nvme/octfm-cache", str(local[i]))], cwd=work,
                              env={**env, **nodes, "NODE": str(i)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"{cmd}\n{out[-3000:]}\n{err[-5000:]}"
    first = outs[0][0]
    assert "on cpu x2" in first and "2 hosts, each reading its own share of the" in first
    assert "global batch 4 = 2 a chip x 2 chip(s) x 1 accumulation step(s)" in first
    fs = gcs_bucket("my-gcs-bucket")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls("my-gcs-bucket/runs/vjepa_multi_domain_vitb")}
    assert {"step_0000002.pt", "step_0000004.pt", "latest.txt", "config.yaml", "metrics.jsonl"} <= names

    # Evaluate: the commands take the gs:// run as README writes them
    run_line = pick(commands, "RUN=")
    assert run_line == f"RUN={BUCKET}/runs/vjepa_multi_domain_vitb"
    assert f"ckpt_dir={BUCKET}/runs/vjepa_multi_domain_vitb" in pick(commands, "PJRT_DEVICE=TPU make pretrain")
    ev = {**env, "RUN": run_line.split("=", 1)[1]}
    probed = run(with_args(pick(commands, "make probe RUN=$RUN"), PROBE_SHRINK), work, ev)
    assert "step_0000004.pt" in probed.stdout and "on cpu" in probed.stdout
    assert f"reading the whole cache it was staged from, {BUCKET}/octfm-cache" in probed.stderr
    local_run = work / "runs" / "vjepa_multi_domain_vitb"
    assert (local_run / "probe" / "diabetic" / "report.md").exists()
    board = run(with_args(pick(commands, "make leaderboard RUN=$RUN"), PROBE_SHRINK), work, ev).stdout
    assert "2 checkpoint(s) on the board, 2 to probe" in board and "leaderboard: ESTIMATE 2 checkpoint(s)" in board
    best = yaml.safe_load((local_run / "best_checkpoint.json").read_text())
    assert {t["ckpt"] for t in best["tasks"].values()} <= {f"{ev['RUN']}/step_000000{s}.pt" for s in (2, 4)}
    embedded = run(pick(commands, "make embed CKPT=$RUN"), work, ev).stdout
    assert re.search(r"embed: \d+ volumes of gs://my-gcs-bucket/octfm-cache -> runs/vjepa_multi_domain_vitb/"
                     r"embeddings.parquet", embedded), embedded
    assert (local_run / "embeddings.parquet").exists()
    run(pick(commands, "make export CKPT=$RUN"), work, ev)
    conf = yaml.safe_load((work / "models" / "vjepa_b" / "config.json").read_text())
    assert conf["training"]["step"] == 4 and conf["cache"]["uri"] == f"{BUCKET}/octfm-cache"

"""The rules a run on several hosts (a TPU pod, torchrun across nodes) depends on: checkpoints
on storage every host sees, every host in the snapshot, nobody leaving before the last write;
and the trainer pieces changed for accelerators (optimizer state before the first step,
the EMA as one foreach op, loader workers from the host's cores)."""
import copy
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port, tiny_train_args
from octfm import fsio
from octfm.config import ConfigError
from train import checkpoint, data, runtime
from train.model import Encoder
from train.config import ModelConfig
from train.ema import ema_update
from train.optim import init_optimizer_state

MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw 0 0
10.0.0.2:/vol1 /mnt/filestore nfs4 rw,vers=4.1 0 0
my-bucket /mnt/gcs fuse.gcsfuse rw,nosuid 0 0
/dev/sdb /mnt/disks/octfm ext4 ro 0 0
"""


@pytest.fixture
def mounts(tmp_path):
    p = tmp_path / "mounts"
    p.write_text(MOUNTS)
    return str(p)


def test_shared_storage_is_an_object_store_or_a_network_file_system(mounts):
    assert fsio.is_shared("gs://bucket/runs/x", mounts)
    assert fsio.is_shared("/mnt/filestore/runs/x/checkpoints", mounts)
    assert fsio.is_shared("/mnt/gcs/runs", mounts)
    assert not fsio.is_shared("/mnt/disks/octfm/runs", mounts)  # a disk attached to each host: not one folder
    assert not fsio.is_shared("/home/me/runs/x/checkpoints", mounts)
    assert fsio.mount_type("/mnt/filestore", mounts) == "nfs4" and fsio.mount_type("/tmp/a/b", mounts) == "tmpfs"


def test_a_multi_host_run_with_a_local_ckpt_dir_is_refused(tmp_path):
    checkpoint.require_shared(str(tmp_path), hosts=1)  # one host: anything goes
    checkpoint.require_shared("gs://bucket/ckpt", hosts=4)
    with pytest.raises(ConfigError, match=r"ckpt_dir: .* is a local folder .* this run spans 4 hosts.*gs://"):
        checkpoint.require_shared(str(tmp_path), hosts=4)


def test_hosts_count_nodes_not_processes(monkeypatch):
    rt = runtime.Runtime("cpu", torch.device("cpu"), world=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert rt.hosts == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert rt.hosts == 1
    assert runtime.Runtime("xla", torch.device("cpu"), world=4).hosts == 4  # SPMD: a process per host
    assert runtime.Runtime("xla", torch.device("cpu")).collective_snapshot
    assert not rt.collective_snapshot


@pytest.mark.slow  # two torchrun launches (about 8 s): the heavy lane, beside the rehearsal's two gs:// nodes
def test_two_torchrun_nodes_with_a_local_ckpt_dir_stop_before_training(tiny_cache, tmp_path):
    """Two torchrun 'nodes' on this machine (one process each, static rendezvous on loopback):
    each sees two hosts, and both refuse the run folder's local checkpoints, naming the key. The light
    lane keeps the rule (test_a_multi_host_run_with_a_local_ckpt_dir_is_refused) and the host count
    (test_hosts_count_nodes_not_processes) in process."""
    port = free_port()
    args = tiny_train_args(tiny_cache, tmp_path / "runs", name="mh", max_steps=2)
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "train.pretrain", "--config", "configs/pretrain_smoke.yaml", "--no-progress", "device=cpu", *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode != 0
        assert "ckpt_dir:" in err and "this run spans 2 hosts" in err, err[-3000:]
    assert not (tmp_path / "runs" / "mh" / "checkpoints").exists()



def test_fine_tuning_on_two_hosts_refuses_a_local_run_folder(tmp_path, monkeypatch):
    """In this process: a Finetuner whose runtime spans two hosts refuses a local
    `out` by name before it reads the checkpoint."""
    from evals import finetune
    from evals.config import FinetuneConfig
    from octfm import config

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = config.load(FinetuneConfig, "configs/finetune.yaml", [f"ckpt={tmp_path / 'never_read.pt'}",
                                                                 f"out={tmp_path / 'ft'}", "device=cpu"])
    with pytest.raises(ConfigError, match=r"out: .* is a local folder .* this run spans 2 hosts.*Set out=gs://"):
        finetune.Finetuner(cfg, runtime.Runtime("cpu", torch.device("cpu"), rank=1, world=2))


@pytest.mark.slow  # two torchrun processes (about 11 s on 2 cores): the heavy lane; the test above is the quick one
def test_two_torchrun_nodes_refuse_a_local_fine_tuning_folder(tmp_path):
    """Fine-tuning, like pretraining, refuses a local run folder on two nodes,
    naming its key (`out`): only rank 0 saves, so the other node could read no finished model and a
    resume would start the nodes at different epochs. It refuses before reading the checkpoint."""
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "evals.finetune", "--no-progress", "--ckpt", str(tmp_path / "never_read.pt"),
               f"out={tmp_path / 'ft'}", "device=cpu"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode != 0
        assert f"out: {tmp_path / 'ft'}" in err and "this run spans 2 hosts" in err, err[-3000:]
    assert not (tmp_path / "ft").exists()

def test_optimizer_state_made_before_the_first_step_changes_nothing(tiny_cache, tmp_path):
    """AdamW's state created up front (one XLA compile per launch) gives the same first steps as
    the state AdamW creates itself."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    a, b = copy.deepcopy(lin), copy.deepcopy(lin)
    oa = torch.optim.AdamW(a.parameters(), lr=torch.tensor(1e-2), fused=True)
    ob = torch.optim.AdamW(b.parameters(), lr=torch.tensor(1e-2), fused=True)
    init_optimizer_state(oa)
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in oa.state.values())
    x = torch.randn(16, 8)
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert oa.state_dict()["state"].keys() == ob.state_dict()["state"].keys()


def test_the_ema_as_one_foreach_op_matches_a_lerp_per_tensor():
    cfg = ModelConfig(dim=32, depth=2, heads=2, pred_dim=16, pred_depth=1, pred_heads=2)
    torch.manual_seed(0)
    online, target = Encoder(cfg, (8, 32, 32)), Encoder(cfg, (8, 32, 32))
    ref = copy.deepcopy(target)
    m = torch.tensor(0.996)
    ema_update(target, online, m)
    with torch.no_grad():
        for t, o in zip(ref.parameters(), online.parameters()):
            t.lerp_(o, 1.0 - m)
    for a, b in zip(target.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    before = copy.deepcopy(target)
    ema_update(target, online, torch.tensor(1.0))  # a skipped update: the target stays exactly
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), before.parameters()))


def test_loader_workers_default_from_the_hosts_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert data.loader_workers(None) == 15
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 GPUs on a 16-core host
    assert data.loader_workers(None) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(240)))  # a TPU v4 host
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert data.loader_workers(None) == data.MAX_DEFAULT_WORKERS
    assert data.loader_workers(3) == 3 and data.loader_workers(0) == 0

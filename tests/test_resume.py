"""Resuming a run under a changed config: the schedules keep the horizon they were set with, and
the data continues where it stopped under another global batch, process count or host count
(train/shares.py), or the resume is refused."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, free_port, run_cli, run_here, tiny_train_args, train_here

from octfm import cli, config
from train import checkpoint, data, pretrain, runtime, shares
from train.config import BEFORE_V1_TAG, TrainConfig

SMOKE = "configs/pretrain_smoke.yaml"


def _train(cache, runs, *args, **extra) -> str:
    """A short run in this process (conftest.train_here); its stdout."""
    return train_here(*args, *tiny_train_args(cache, runs, **extra))


def _logged(runs, name="t") -> dict:
    out = {}
    for line in open(runs / name / "metrics.jsonl"):
        r = json.loads(line)
        if r["split"] == "train":
            out[r["step"]] = r
    return out


def test_raising_max_steps_runs_a_constant_tail_at_the_final_values(tiny_cache, tmp_path):
    runs = tmp_path / "runs"
    _train(tiny_cache, runs, max_steps=6, ckpt_every=6)
    out = _train(tiny_cache, runs, max_steps=9, ckpt_every=3)
    assert "constant tail" in out and "max_steps 6 -> 9" in out
    # the start line states the recipe's batch as laid out here, and what the one host reads
    assert "global batch 4 = 4 a chip x 1 chip(s) x 1 accumulation step(s)" in out and "tokens per step" in out
    assert "one host: every process of it draws from all" in out
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(tiny_cache, runs))
    log = _logged(runs)
    for step in (7, 8, 9):  # the lr and momentum the step ran with
        assert log[step]["lr"] == pytest.approx(cfg.optim.final_lr)
        assert log[step]["ema_momentum"] == pytest.approx(cfg.optim.ema[1])
    st = checkpoint.load(str(runs / "t" / "checkpoints" / "latest.pt"))
    assert st["schedule"] == {"horizon": 6}


def test_lowering_max_steps_stops_early_on_the_first_schedule(tiny_cache, tmp_path):
    full, short = tmp_path / "full", tmp_path / "short"
    _train(tiny_cache, full, max_steps=10, ckpt_every=3)
    step3 = str(full / "t" / "checkpoints" / "step_0000003.pt")
    out = _train(tiny_cache, short, "--ckpt", step3, max_steps=5, ckpt_every=5)
    assert "stops at step 5" in out
    a, b = _logged(full), _logged(short)
    assert max(b) == 5
    assert [b[s]["lr"] for s in (4, 5)] == [a[s]["lr"] for s in (4, 5)]
    assert [b[s]["ema_momentum"] for s in (4, 5)] == [a[s]["ema_momentum"] for s in (4, 5)]


def test_a_checkpoint_from_before_the_v1_cut_is_refused_naming_the_tag(tiny_cache, tmp_path):
    """A checkpoint without `format` was written before the v1 cut: a resume refuses it (rather than
    skipping it as damaged and starting afresh beside it), and so does every reader of an encoder
    (make finetune, export, embed, probe), each naming the git tag whose code reads it."""
    from evals import features

    runs = tmp_path / "runs"
    _train(tiny_cache, runs, max_steps=1, ckpt_every=1)
    path = runs / "t" / "checkpoints" / "step_0000001.pt"
    st = torch.load(path, weights_only=True)
    assert st.pop("format") == checkpoint.FORMAT
    torch.save(st, path)
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(tiny_cache, runs, max_steps=2))
    tag = f"from before octfm's v1 cut; load it with the tag {BEFORE_V1_TAG}"
    with pytest.raises(cli.UsageError, match=f"step_0000001.pt: a checkpoint .*{tag}"):
        pretrain.Trainer(cfg, runtime.setup("cpu", "fp32"))
    with pytest.raises(cli.UsageError, match=tag):
        features.checkpoint_encoder(str(runs / "t" / "checkpoints" / "latest.pt"))


@pytest.mark.parametrize("old,new", [((2, 1), (2, 2)), ((4, 1), (2, 1)), ((2, 2), (1, 4)), ((3, 1), (1, 3))])
def test_a_converted_position_continues_the_same_order(old, new):
    """Fine-tuning's sampler: what the processes draw next, together, is what the old layout
    would have drawn next (for every position where the new global batch fits)."""
    n, seed = 37, 3
    for consumed in range(0, 40):
        pos = data.data_position(consumed, n, *old)
        start = data.start_batch_for(pos, n, *new)
        if start is None:
            assert pos["offset"] % (new[0] * new[1])
            continue
        nb, nw = new
        epoch_len = (n // (nb * nw)) * nb * nw
        if pos["offset"] >= epoch_len:
            continue  # past the new layout's trimmed epoch: it starts the next one
        perm = data.EpochSampler(n, 1, 0, 1, seed).epoch_indices(pos["epoch"])  # the epoch's whole order
        got = set()
        for rank in range(nw):
            it = iter(data.EpochSampler(n, nb, rank, nw, seed, start_batch=start))
            got |= {next(it) for _ in range(nb)}
        want = {(pos["epoch"], i) for i in perm[pos["offset"]:pos["offset"] + nb * nw]}
        assert got == want, (consumed, pos)


@pytest.mark.parametrize("old,new", [((2, 1), (2, 2)), ((4, 1), (2, 1)), ((2, 2), (1, 4)), ((3, 1), (1, 3))])
def test_a_host_share_position_continues_the_same_order_on_other_processes(old, new):
    """Pretraining's sampler on each of two hosts: with another per-process batch or another
    count of processes per host, what a host's processes draw next, together, is what the old
    layout would have drawn next from that host's share."""
    rows = [{"volume": f"v{i}", "relpath": f"r{i:02d}", "device": "abcd"[i % 4]} for i in range(37)]
    sizes = {r["volume"]: 100 + 7 * i for i, r in enumerate(rows)}
    parts, seed, hosts = shares.shares(rows, sizes, 2), 3, 2
    for host, share in enumerate(parts):
        def sampler(b, local, rank=0, start=0):
            n = shares.epoch_length([len(p) for p in parts], b * local)
            return shares.ShareSampler(share, n, b, rank, local, seed, start_batch=start)
        for consumed in range(0, 40):
            pos = shares.share_position(consumed, sampler(*old), hosts)
            start, note = shares.start_for(pos, sampler(*new), hosts)
            assert note is None
            if start is None:
                assert pos["offset"] % (new[0] * new[1])
                continue
            nb, nw = new
            if pos["offset"] >= sampler(*new).batches_per_epoch * nb * nw:
                continue  # past the new layout's trimmed epoch: it starts the next one
            whole = sampler(1, 1).epoch_indices(pos["epoch"])  # the host's order in that epoch
            got = set()
            for rank in range(nw):
                it = iter(sampler(nb, nw, rank, start))
                got |= {next(it) for _ in range(nb)}
            assert got == {(pos["epoch"], i) for i in whole[pos["offset"]:pos["offset"] + nb * nw]}, (consumed, pos)


def test_another_host_count_goes_on_at_the_next_epoch():
    """Other hosts deal other shares: a run resumed on them goes on at the next epoch's start, saying
    so; a checkpoint written before positions named their hosts reads as one host."""
    share = list(range(20))
    s = shares.ShareSampler(share, 20, 2)
    start, note = shares.start_for({"epoch": 3, "offset": 6, "hosts": 2}, s, 4)
    assert start == 4 * s.batches_per_epoch and "2 host(s) -> 4" in note and "epoch 4" in note
    assert shares.start_for({"epoch": 3, "offset": 6}, s, 1) == (3 * s.batches_per_epoch + 3, None)


def test_one_host_draws_the_order_training_always_drew():
    """With one host the share sampler is the epoch sampler of one permutation of every row dealt
    to the processes (what a run drew before hosts had shares): the demo and the check keep their data."""
    for n, b, world in ((56, 4, 1), (37, 2, 2), (40, 3, 4)):
        (share,) = shares.shares([{"volume": str(i), "relpath": str(i), "device": "d"} for i in range(n)], None, 1)
        epoch_len = shares.epoch_length([n], b * world)
        for rank in range(world):
            new = shares.ShareSampler(share, epoch_len, b, rank, world, seed=5, start_batch=3, stop_batch=40)
            old = data.EpochSampler(n, b, rank, world, seed=5, start_batch=3, stop_batch=40)
            assert list(new) == list(old)


def test_a_position_the_new_batch_cannot_reach_is_refused(tiny_cache, tmp_path):
    runs = tmp_path / "runs"
    _train(tiny_cache, runs, max_steps=1, ckpt_every=1, global_batch=2)   # 2 samples in
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(tiny_cache, runs, max_steps=3, global_batch=4))
    with pytest.raises(cli.UsageError) as e:
        pretrain.Trainer(cfg, runtime.setup("cpu", "fp32"))
    msg = str(e.value)
    assert "global batch 2 on 1 process(es)" in msg and "global batch 4 on 1 process(es)" in msg
    assert "step_0000001.pt" in msg
    r = run_here("train.pretrain", "--config", SMOKE, "--no-progress", *tiny_train_args(tiny_cache, runs, max_steps=3,
                                                                                       global_batch=4))
    assert r.returncode == 2 and "global batch 4" in r.stderr


@pytest.mark.slow  # two torchrun launches (about 20 s): the heavy lane
def test_one_process_resumed_on_two_continues_the_data(tiny_cache, tmp_path):
    """A run on one process (global batch 4) resumed on two at a global batch of 8 with torchrun
    (4 a process): the position is converted (8 samples in: one global batch), and the two
    processes train as one process with batch 8 resumed from the same checkpoint."""
    first = tmp_path / "first"
    _train(tiny_cache, first, max_steps=2, ckpt_every=2, global_batch=4)
    ckpt = str(first / "t" / "checkpoints" / "step_0000002.pt")
    one = tmp_path / "one"
    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", "--ckpt", ckpt,
                *tiny_train_args(tiny_cache, one, max_steps=3, ckpt_every=3, global_batch=8))
    assert r.returncode == 0, r.stderr[-3000:]
    two = tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "train.pretrain", "--config", SMOKE, "--no-progress", "--ckpt", ckpt,
                        *tiny_train_args(tiny_cache, two, max_steps=3, ckpt_every=3, global_batch=8)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cpu x2" in r.stdout and "global batch 4 on 1 process(es) -> 8 on 2" in r.stdout
    a = checkpoint.load(str(one / "t" / "checkpoints" / "latest.pt"))
    b = checkpoint.load(str(two / "t" / "checkpoints" / "latest.pt"))
    assert b["world"] == 2 and b["consumed_batches"] == 2   # 1 batch to reach 8 samples, 1 more step
    assert a["data_position"] == b["data_position"]
    n = len(data.select_rows(str(tiny_cache), ["train"], None))
    epoch, done = divmod(2, n // 8)   # two micro-batches of 4 a process on 2, in epochs of n // 8 steps
    assert b["data_position"] == {"epoch": epoch, "offset": done * 8, "hosts": 1}
    assert _logged(one)[3]["loss"] == pytest.approx(_logged(two)[3]["loss"], rel=1e-4)

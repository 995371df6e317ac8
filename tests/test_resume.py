"""Resuming a run under a changed config: the schedules keep the horizon they were set with
and the data continues where it stopped under another batch size or
process count, or the resume is refused."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, free_port, run_cli, run_here, tiny_train_args, train_here

from octfm import cli, config
from train import checkpoint, data, pretrain, runtime
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
    """What the processes draw next, together, is what the old layout would have drawn next
    (for every position where the new global batch fits)."""
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


def test_a_position_the_new_batch_cannot_reach_is_refused(tiny_cache, tmp_path):
    runs = tmp_path / "runs"
    _train(tiny_cache, runs, max_steps=1, ckpt_every=1, batch_size=2)   # 2 samples in
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(tiny_cache, runs, max_steps=3, batch_size=4))
    with pytest.raises(cli.UsageError) as e:
        pretrain.Trainer(cfg, runtime.setup("cpu", "fp32"))
    msg = str(e.value)
    assert "batch_size 2 x 1 process(es)" in msg and "batch_size 4 x 1 process(es)" in msg and "step_0000001.pt" in msg
    r = run_here("train.pretrain", "--config", SMOKE, "--no-progress", *tiny_train_args(tiny_cache, runs, max_steps=3,
                                                                                       batch_size=4))
    assert r.returncode == 2 and "batch_size 4" in r.stderr


@pytest.mark.slow  # two torchrun launches (about 20 s): the heavy lane
def test_one_process_resumed_on_two_continues_the_data(tiny_cache, tmp_path):
    """A run on one process (batch 4) resumed on two (batch 4 each: a global batch of 8) with
    torchrun: the position is converted (8 samples in: one global batch), and the two
    processes train as one process with batch 8 resumed from the same checkpoint."""
    first = tmp_path / "first"
    _train(tiny_cache, first, max_steps=2, ckpt_every=2, batch_size=4)
    ckpt = str(first / "t" / "checkpoints" / "step_0000002.pt")
    one = tmp_path / "one"
    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", "--ckpt", ckpt,
                *tiny_train_args(tiny_cache, one, max_steps=3, ckpt_every=3, batch_size=8))
    assert r.returncode == 0, r.stderr[-3000:]
    two = tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "train.pretrain", "--config", SMOKE, "--no-progress", "--ckpt", ckpt,
                        *tiny_train_args(tiny_cache, two, max_steps=3, ckpt_every=3, batch_size=4)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cpu x2" in r.stdout and "batch_size 4 x 1 process(es) -> 4 x 2" in r.stdout
    a = checkpoint.load(str(one / "t" / "checkpoints" / "latest.pt"))
    b = checkpoint.load(str(two / "t" / "checkpoints" / "latest.pt"))
    assert b["world"] == 2 and b["consumed_batches"] == 2   # 1 batch to reach 8 samples, 1 more step
    assert a["data_position"] == b["data_position"]
    n = len(data.select_rows(str(tiny_cache), ["train"], None))
    assert b["data_position"] == data.data_position(2, n, 4, 2)
    assert _logged(one)[3]["loss"] == pytest.approx(_logged(two)[3]["loss"], rel=1e-4)

import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, guard_driver, run_cli, run_here, same_optimizer, same_weights, tiny_train_args

from octfm import config
from train import checkpoint, data, guard, pretrain, runtime, schedule, startup
from train.config import OptimConfig, TrainConfig
from train.optim import GUARD_PATHS, guarded_step

SMOKE = "configs/pretrain_smoke.yaml"


def tiny_trainer(cache, tmp_path, **extra) -> pretrain.Trainer:
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(cache, tmp_path / "runs", **extra))
    return pretrain.Trainer(cfg, runtime.setup("cpu", "fp32"))


def first_batch(trainer):
    _, dl = trainer.train_loader(0)
    return trainer.rt.to_device(next(iter(dl)))


def test_overfitting_a_tiny_batch_lowers_loss_without_collapse(tiny_cache, tmp_path):
    from train import metrics

    tr = tiny_trainer(tiny_cache, tmp_path)
    batch = first_batch(tr)
    tr.lr.fill_(3e-3)
    tr.momentum.fill_(0.99)
    losses, norms = [], []
    for _ in range(150):
        loss, gnorm, targets = tr.update([batch], tr.model)
        tr.step += 1
        losses.append(float(loss))
        norms.append(float(gnorm))
    assert losses[-1] < 0.6 * losses[0], (losses[0], min(losses), losses[-1])
    assert min(norms) > 0
    assert metrics.feature_std(targets) > 0.2
    assert metrics.rankme(targets) > 4.0  # of at most 32 (the width): not collapsed
    assert int(tr.guard.skipped) == 0


def test_rankme_and_std_detect_collapse():
    from train import metrics

    collapsed = torch.ones(64, 32) + 1e-6 * torch.randn(64, 32)
    healthy = torch.randn(64, 32)
    assert metrics.rankme(collapsed) < 1.5 < 20 < metrics.rankme(healthy)
    assert metrics.feature_std(collapsed) < 1e-3 < 0.5 < metrics.feature_std(healthy)


def test_lr_schedule_warms_up_then_decays_monotonically_and_never_restarts():
    cfg = OptimConfig(lr=1e-3, start_lr=0.0, final_lr=1e-6, warmup_steps=100)
    total = 1000
    lrs = [schedule.learning_rate(s, total, cfg) for s in range(total + 200)]
    assert lrs[0] == 0.0 and all(a < b for a, b in zip(lrs[:100], lrs[1:101]))
    after = lrs[100:]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert lrs[-1] == pytest.approx(1e-6) and max(lrs[total:]) == pytest.approx(1e-6)
    m = [schedule.ema_momentum(s, total, cfg) for s in range(0, total + 10)]
    assert all(a <= b for a, b in zip(m, m[1:])) and m[-1] == cfg.ema[1]


def test_schedules_on_a_device_step_match_the_host_values():
    """The trainer computes both schedules from a float32 step tensor (no host copy per step):
    the same values as the host functions at every step, warmup, cosine and the held tail."""
    cfg = OptimConfig(lr=1e-3, start_lr=1e-5, final_lr=1e-6, warmup_steps=37, ema=(0.99, 1.0))
    total = 500
    steps = torch.arange(total + 50, dtype=torch.float32)
    for fn in (schedule.learning_rate, schedule.ema_momentum):
        host = torch.tensor([fn(s, total, cfg) for s in range(total + 50)], dtype=torch.float64)
        dev = torch.stack([fn(t, total, cfg) for t in steps]).double()
        # float32 rounding: within 1e-6 of the value and 1e-6 of the peak (the cosine's 1 + cos(pi t) near its end)
        assert torch.allclose(dev, host, rtol=1e-6, atol=1e-6 * cfg.lr), (fn.__name__, (dev - host).abs().max())
    no_warmup = OptimConfig(lr=1e-3, warmup_steps=0)
    assert float(schedule.learning_rate(torch.tensor(0.0), 10, no_warmup)) == pytest.approx(1e-3)


def test_non_finite_loss_skips_the_update(tiny_cache, tmp_path):
    tr = tiny_trainer(tiny_cache, tmp_path)
    batch = first_batch(tr)
    tr.update([batch], tr.model)
    tr.step += 1
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    target_before = {k: v.clone() for k, v in tr.target.state_dict().items()}
    bad = dict(batch, aug=torch.full_like(batch["aug"], float("nan")))
    loss, _, _ = tr.update([bad], tr.model)
    assert not torch.isfinite(loss)
    assert int(tr.guard.skipped) == 1 and int(tr.guard.skip_run) == 1
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in tr.target.state_dict().items():
        assert torch.equal(v, target_before[k]), k
    assert torch.isfinite(tr.guard.loss_mean)
    loss, _, _ = tr.update([batch], tr.model)  # and training goes on
    assert torch.isfinite(loss) and int(tr.guard.skipped) == 1 and int(tr.guard.skip_run) == 0


def test_the_update_guard_refuses_non_finite_values_and_spikes():
    """Pretraining's guard also refuses a loss over spike_factor x the running mean of accepted
    losses; fine-tuning's (no spike_factor) only non-finite values. A refused update leaves the
    mean as it was and lengthens the run of skips; an accepted one moves the mean and ends it."""
    pre, ft = guard.UpdateGuard(torch.device("cpu"), spike_factor=5.0), guard.UpdateGuard(torch.device("cpu"))
    one, two, spike, nan = (torch.tensor(v) for v in (1.0, 2.0, 11.0, float("nan")))
    for g in (pre, ft):
        g.record(g.accepts(two, one), two)  # the first accepted loss is the mean
    assert float(pre.loss_mean) == 2.0
    assert not pre.accepts(spike, one) and ft.accepts(spike, one)
    assert not any(g.accepts(*values) for g in (pre, ft) for values in ((nan, one), (one, nan)))
    pre.record(pre.accepts(spike, one), spike)
    assert float(pre.loss_mean) == 2.0 and int(pre.skipped) == 1 and int(pre.skip_run) == 1
    pre.record(pre.accepts(one, one), one)
    assert float(pre.loss_mean) == pytest.approx(1.9) and int(pre.skipped) == 1 and int(pre.skip_run) == 0


@pytest.mark.parametrize("path", GUARD_PATHS)
def test_guarded_step_is_exact_on_every_path(path):
    """Every path of the guard (fused AdamW's found_inf as CPU and CUDA run it, the host branch,
    XLA's copy and select, here on CPU): an accepted step equals a bare AdamW step, a refused one
    (NaN gradients) leaves the weights, both moments and the step count bit-identical, the first
    update included."""
    def fresh():
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 4)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=path == "found_inf")

    def grads(m, value=None):
        for p in m.parameters():
            p.grad = torch.full_like(p, value) if value is not None else p.detach() * 0.5 + 0.1

    ref, ref_opt = fresh()
    m, opt = fresh()
    grads(m, float("nan"))
    guarded_step(opt, torch.tensor(False), path)        # a refused first update
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    assert all(not {k: v for k, v in opt.state[p].items() if torch.is_tensor(v) and v.abs().sum() > 0}
               for p in m.parameters())
    for _ in range(2):                                                    # accepted: as a bare step
        grads(m), grads(ref)
        guarded_step(opt, torch.tensor(True), path)
        ref_opt.step()
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()}
    weights = [p.detach().clone() for p in m.parameters()]
    grads(m, float("nan"))
    guarded_step(opt, torch.tensor(False), path)        # refused: nothing moves
    for p, w, r in zip(m.parameters(), weights, ref.parameters()):
        assert torch.equal(p, w) and torch.equal(p, r)
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[id(p)][k])), k
        for k, v in ref_opt.state[r].items():
            assert torch.equal(torch.as_tensor(opt.state[p][k]), torch.as_tensor(v)), k


def test_bad_config_key_is_named(tiny_cache, tmp_path):
    r = run_cli("train.pretrain", "--config", SMOKE, *tiny_train_args(tiny_cache, tmp_path), "model.dimm=3")
    assert r.returncode == 2 and "model.dimm" in r.stderr and SMOKE in r.stderr


def test_ckpt_dir_null_means_the_run_folder(tiny_cache, tmp_path):
    cfg = config.load(TrainConfig, SMOKE, tiny_train_args(tiny_cache, tmp_path / "runs") + ["ckpt_dir=null"])
    assert cfg.ckpt_dir is None
    tr = pretrain.Trainer(cfg, runtime.setup("cpu", "fp32"))
    assert tr.ckpt_dir == str(tmp_path / "runs" / "t" / "checkpoints")


def _last_by_step(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if r["split"] == "train":
            out[r["step"]] = r
    return out


@pytest.mark.slow
def test_killed_run_resumes_bit_for_bit(tiny_cache, tmp_path):
    """Uninterrupted (no loader workers) vs killed with kill -9 and resumed (2 spawn workers):
    same losses, same weights, same optimizer state, bit for bit on CPU in float32."""
    common = dict(max_steps=30, ckpt_every=5)
    ref_args = tiny_train_args(tiny_cache, tmp_path / "a", name="ref", **common)
    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *ref_args)
    assert r.returncode == 0, r.stderr
    args = tiny_train_args(tiny_cache, tmp_path / "b", name="ref", **{**common, "data.workers": 2})
    ckdir = tmp_path / "b" / "ref" / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-m", "train.pretrain", "--config", SMOKE, "--no-progress", *args],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (ckdir / "step_0000005.pt").exists() and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (ckdir / "step_0000030.pt").exists()
    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *args)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    a = checkpoint.load(str(tmp_path / "a" / "ref" / "checkpoints" / "latest.pt"))
    b = checkpoint.load(str(ckdir / "latest.pt"))
    assert a["step"] == b["step"] == 30
    assert same_weights(a, b)
    assert a["optimizer"]["state"] and same_optimizer(a, b)
    la = _last_by_step(tmp_path / "a" / "ref" / "metrics.jsonl")
    lb = _last_by_step(tmp_path / "b" / "ref" / "metrics.jsonl")
    assert [la[s]["loss"] for s in range(1, 31)] == [lb[s]["loss"] for s in range(1, 31)]
    keys = {"step", "epoch", "loss", "lr", "grad_norm", "ema_momentum", "samples_per_s", "tokens_per_s",
            "data_wait_frac", "target_std", "rankme", "skipped_updates"}
    assert keys <= set(la[30])
    assert (tmp_path / "a" / "ref" / "config.yaml").exists()
    assert sorted(p.name for p in ckdir.glob("step_*.pt")) == [f"step_{s:07d}.pt" for s in range(5, 31, 5)]


@pytest.mark.slow  # about 24 s on 2 cores (make test at its time): the heavy lane, beside the other torchrun tests
def test_two_process_ddp_matches_one_process(tiny_cache, tmp_path):
    one = tiny_train_args(tiny_cache, tmp_path / "one", name="d", max_steps=3, global_batch=4)
    r = run_cli("train.pretrain", "--config", SMOKE, "--no-progress", *one)
    assert r.returncode == 0, r.stderr
    two = tiny_train_args(tiny_cache, tmp_path / "two", name="d", max_steps=3, global_batch=4)   # 2 a process
    env = {"OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(_free_port()), "-m", "train.pretrain", "--config", SMOKE, "--no-progress", *two],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cpu x2" in r.stdout
    a = checkpoint.load(str(tmp_path / "one" / "d" / "checkpoints" / "latest.pt"))
    b = checkpoint.load(str(tmp_path / "two" / "d" / "checkpoints" / "latest.pt"))
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5)
    la = _last_by_step(tmp_path / "one" / "d" / "metrics.jsonl")
    lb = _last_by_step(tmp_path / "two" / "d" / "metrics.jsonl")
    for s in (1, 2, 3):
        assert la[s]["loss"] == pytest.approx(lb[s]["loss"], rel=1e-4)


@pytest.mark.slow  # two torchrun ranks, about 19 s: the heavy lane, beside the other torchrun tests
def test_ddp_spike_on_one_rank_is_skipped_by_both(tiny_cache, tmp_path):
    """A loss spike on rank 1 only: both ranks skip that update exactly and stay identical
    (weights, EMA target, optimizer moments and step counts) at every step."""
    args = tiny_train_args(tiny_cache, tmp_path / "runs", global_batch=4)   # 2 a rank
    r0, r1 = guard_driver(tmp_path / "out", steps=4, spikes={3: "1e4"}, spike_rank=1, overrides=args, nproc=2)
    assert r0["skipped"] == r1["skipped"] == [0, 0, 1, 1]
    for a, b in zip(r0["states"], r1["states"]):
        assert same_weights(a, b) and same_optimizer(a, b)
    before, spiked, after = r0["states"][1:]
    assert same_weights(before, spiked) and same_optimizer(before, spiked)
    assert not same_weights(spiked, after)  # and training went on


def test_update_guard_lockout_stops_the_run_naming_step_and_checkpoint(tiny_cache, tmp_path):
    """A loss that can never pass the guard (spike_factor tiny): after max_consecutive_skips
    skipped updates the run stops with status 1, naming the step and the newest checkpoint."""
    args = tiny_train_args(tiny_cache, tmp_path, name="lock", max_steps=20, ckpt_every=2,
                           **{"optim.spike_factor": 1e-6, "optim.max_consecutive_skips": 3})
    r = run_here("train.pretrain", "--config", SMOKE, "--no-progress", *args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    ckpts = tmp_path / "lock" / "checkpoints"
    assert "up to step 4 were all skipped" in r.stderr and str(ckpts / "step_0000002.pt") in r.stderr, r.stderr
    assert not (ckpts / "step_0000004.pt").exists()  # it stops before saving what it skipped
    recs = _last_by_step(tmp_path / "lock" / "metrics.jsonl")
    assert sorted(recs) == [1, 2, 3, 4] and recs[4]["consecutive_skips"] == 3 and recs[4]["skipped_updates"] == 3


def _free_port():
    from conftest import free_port

    return free_port()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_checkpoint_with_a_pickled_object_is_refused(tmp_path):
    buf = io.BytesIO()
    torch.save({"model": {}, "payload": _Evil()}, buf)
    (tmp_path / "evil.pt").write_bytes(buf.getvalue())
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load(str(tmp_path / "evil.pt"))


def wandb_records(path) -> list:
    """The protobuf Records of an offline .wandb file, read without the W&B service. The file is
    a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks
    [crc32, length (2 bytes), type (1 full, 2 first, 3 middle, 4 last)] + data."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_run_has_the_jsonl_names_the_config_and_checkpoints(wandb_run):
    """The tiny run with W&B offline, as `make pretrain` starts it: W&B holds metrics.jsonl's records under
    the same names, the run's config and each checkpoint as an artifact."""
    tiny_run = wandb_run
    files = list((tiny_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    recs = wandb_records(files[0])
    history, config_keys, artifacts = {}, None, []
    for r in recs:
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            config_keys = {i.key: json.loads(i.value_json) for i in r.run.config.update if i.key != "_wandb"}
        elif kind == "artifact":
            a = r.artifact
            artifacts.append((a.type, a.name, sorted(a.aliases), [e.path for e in a.manifest.contents]))
    expected = {}
    for line in (tiny_run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        split, step = row.pop("split"), row.pop("step")
        expected.setdefault(step, {}).update({f"{split}/{k}": v for k, v in row.items()})
    assert sorted(history) == sorted(expected) == [0, 1, 2, 3, 4]
    assert "val/loss" in history[2] and "val/loss" in history[4]
    assert all(f"probe/{t}/knn_bal_acc" in history[s] for t in ("study_group", "diabetic") for s in (0, 2, 4))
    for step, want in expected.items():
        assert history[step] == pytest.approx(want), step  # same names, same values as metrics.jsonl
    cfg = yaml.safe_load((tiny_run / "config.yaml").read_text())
    assert config_keys == cfg
    assert artifacts == [("model", "tiny-checkpoint", ["latest", f"step_{s}"], [f"step_{s:07d}.pt"]) for s in (2, 4)]


def test_resume_prefers_the_newest_step_file_over_a_stale_latest(tmp_path):
    """A kill between writing step_<N>.pt and pointing latest at it must not lose step N."""
    checkpoint.save({"step": 3}, str(tmp_path), 3)
    (tmp_path / "step_0000006.pt").write_bytes((tmp_path / "step_0000003.pt").read_bytes())
    assert checkpoint.newest_whole(str(tmp_path)).endswith("step_0000006.pt")
    uri, state = checkpoint.load_newest_good(str(tmp_path))
    assert uri.endswith("step_0000006.pt") and state["step"] == 3
    checkpoint.save({"step": 9}, str(tmp_path), 9, keep_last=2)
    assert checkpoint.list_steps(str(tmp_path)) == [6, 9]


def test_prefetcher_hands_out_every_batch_in_order_one_copy_ahead():
    """runtime.Prefetcher (CUDA's side-stream copy; its CPU path here): the loader's batches,
    each on the device, in order, none lost at the end; batch k+1's copy is issued before
    batch k is handed out (so it overlaps batch k's compute); an empty loader yields nothing."""
    drawn = []

    def loader():
        for i in range(5):
            drawn.append(i)
            yield {"x": torch.full((2, 3), float(i)), "aug": torch.tensor([i])}

    seen = []
    for b in runtime.Prefetcher(loader(), "cpu"):
        k = int(b["aug"][0])
        seen.append(k)
        assert b["x"].device.type == "cpu" and float(b["x"][0, 0]) == k
        assert drawn[-1] == min(k + 1, 4), (k, drawn)
    assert seen == [0, 1, 2, 3, 4]
    assert list(runtime.Prefetcher([], "cpu")) == []


def test_startup_dates_the_loader_workers_start(tmp_path):
    """The first batch's wait split by the workers themselves (the H200's 89 s, docs/accelerators.md):
    each worker notes when its process was forked and when it was ready, and the startup record
    reads them back in seconds after the loop began, ordered (forked before ready)."""
    import functools

    from torch.utils.data import DataLoader

    logged = []
    st = startup.Startup(type("Log", (), {"log": lambda self, rec, prefix: logged.append(rec)})(), show=False)
    assert st.workers() == {}  # no worker yet: nothing claimed
    from octfm import procs

    dl = DataLoader(list(range(8)), batch_size=4, num_workers=2, multiprocessing_context=procs.worker_context(),
                    worker_init_fn=functools.partial(data.note_worker_start, st.worker_log))
    t0 = time.time()
    assert [b.tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    elapsed = time.time() - st.wall
    w = st.workers()
    assert w["workers_ready"] == 2
    assert t0 - st.wall - 0.02 <= w["workers_last_forked_at"] <= w["workers_last_ready_at"]  # dated to a clock tick
    assert 0 < w["workers_first_ready_at"] <= w["workers_last_ready_at"] <= elapsed + 0.001
    pids = {json.loads(x)["pid"] for x in Path(st.worker_log).read_text().splitlines()}
    assert len(pids) == 2 and os.getpid() not in pids  # written by the worker processes themselves
    st.after_step(1, torch.zeros(()), fetch_s=0.0)  # the first step: the record, and the folder removed
    st.after_step(2, torch.zeros(()), fetch_s=0.0)  # then nothing
    assert len(logged) == 1 and logged[0]["step"] == 1 and logged[0]["workers_ready"] == 2
    assert list(logged[0])[1:3] == ["first_batch_s", "first_update_s"]
    data.note_worker_start(st.worker_log, 2)  # a late worker must not fail: the record is already out


@pytest.mark.parametrize("broken", ["proc", "boottime"])
def test_a_worker_starts_where_its_start_cannot_be_dated(tmp_path, monkeypatch, broken):
    """A system without /proc (or CLOCK_BOOTTIME) must not stop a loader worker
    over a diagnostic: note_worker_start returns, and notes nothing it could not date."""
    import builtins

    log = tmp_path / "workers.jsonl"
    log.touch()
    real_open = builtins.open

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *a, **k)

    if broken == "proc":
        monkeypatch.setattr(builtins, "open", no_proc)
    else:
        monkeypatch.delattr(time, "CLOCK_BOOTTIME")
    data.note_worker_start(str(log), 0)
    assert log.read_text() == ""


def test_a_run_records_where_its_startup_went(tiny_run):
    """One `startup` record after the first step: the resident load, the loader, the step-0
    online probe, the first batch and the first update, each timed, summing to the total
    (docs/accelerators.md: the first H200 run spent 97 s before its first step, not known where)."""
    recs = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in recs if r["split"] == "startup"]
    assert len(starts) == 1 and starts[0]["step"] == 1
    laps = {k: v for k, v in starts[0].items() if k.endswith("_s") and k != "total_s"}
    # the loader first: its workers start while the volumes load and the probe runs
    assert list(laps) == ["loader_s", "resident_s", "online_probe_s", "first_batch_s", "first_update_s"]
    assert "workers_ready" not in starts[0]  # data.workers: 0, no worker to date
    assert all(v >= 0 for v in laps.values()) and laps["online_probe_s"] > 0  # eval_every: the step-0 probe ran
    assert starts[0]["total_s"] == pytest.approx(sum(laps.values()), abs=0.01)


def test_loader_workers_start_together_not_one_after_another(tiny_cache):
    """The H200's 89-s first batch (docs/accelerators.md): a worker imported what its job needs
    while the parent's write of the job (the dataset, larger than a pipe's buffer) waited, so
    torch's loop started the workers one after another. With the process server preloading
    our modules (octfm/procs.py) the workers are ready together; without it the second waits
    for the first's import of torch and train.data (seconds)."""
    import functools

    from torch.utils.data import DataLoader

    from octfm import procs

    rows = data.select_rows(str(tiny_cache), ["train", "val", "test"], None) * 2000  # ~0.3 MB pickled
    cfg = config.load(TrainConfig, "configs/pretrain_smoke.yaml", [f"data.cache={tiny_cache}", "data.stride=[1,1,1]",
                                                                    "data.input_shape=[16,48,48]"])
    ds = data.CacheDataset(rows, cfg.data, None, None, None, seed=0, volumes=False)
    assert len(pickle.dumps(ds)) > 2 ** 16  # more than a pipe holds: the write waits for the worker to read
    st = startup.Startup(None, show=False)
    dl = DataLoader(ds, batch_size=2, sampler=[(0, i) for i in range(4)], num_workers=2,
                    multiprocessing_context=procs.worker_context(),
                    worker_init_fn=functools.partial(data.note_worker_start, st.worker_log))
    it = iter(dl)
    next(it)
    del it
    time.sleep(0.2)
    w = st.workers()
    assert w["workers_ready"] == 2
    assert w["workers_last_ready_at"] - w["workers_first_ready_at"] < 0.5, w


@pytest.mark.parametrize("main, preloaded", [("check.learning_check", True), ("train.pretrain", True),
                                              ("pytest.__main__", False), ("somepkg.cli", False), (None, False)])
def test_the_process_server_preloads_what_our_main_module_imported(monkeypatch, main, preloaded):
    """For a running `python -m` module of ours the server preloads our modules imported so far
    (the main module's imports), never the main module itself (runpy would warn in each worker);
    for a foreign one only the heavy modules (`pytest.__main__`'s imports are not ours)."""
    import types

    from check import learning_check  # noqa: F401  (in sys.modules by its name, as a test's import puts it)
    from octfm import procs

    fake = types.ModuleType("__main__")
    fake.__spec__ = types.SimpleNamespace(name=main) if main else None
    monkeypatch.setitem(sys.modules, "__main__", fake)
    mods = procs.preload_modules()
    assert mods[:4] == ["torch", "cache.worker", "train.data", "monai.transforms"]
    assert main not in mods and ("train.pretrain" in mods) is (preloaded and main != "train.pretrain")
    assert (len(mods) > 4) is preloaded


def test_workers_of_a_python_m_main_start_without_runpy_warnings(tmp_path):
    """`python -m ingest.synth` with its process pool (64 participants and up): each forkserver
    worker runs the main module again; with the main module preloaded by its name runpy warned
    "found in sys.modules" once per worker (15 times per loader on the H200)."""
    r = subprocess.run([sys.executable, "-m", "ingest.synth", "--out", str(tmp_path / "s"), "--participants", "64",
                        "--scale", "16", "--no-bad-files", "--unlabeled", "0"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "found in sys.modules" not in r.stderr, r.stderr[-2000:]
    assert len(list((tmp_path / "s").rglob("*.dcm"))) >= 64

def test_a_pool_that_needs_less_starts_a_lighter_server_and_a_loader_replaces_it(tmp_path):
    """A pool that asks for fewer preloads (the cache build's: cache.build.WORKER_IMPORTS, no MONAI
    or trainer) gets a server with only those in a process without torch; a training loader later
    in the same process gets a new server with the heavy list. Once the process has imported torch
    (this test's does) every pool gets the heavy list."""
    from cache import build
    from ingest import synth
    from octfm import procs

    assert not {"monai.transforms", "train.data"} & {*build.WORKER_IMPORTS, *synth.WRITER_IMPORTS}
    assert procs.server_modules(build.WORKER_IMPORTS)[:4] == list(procs.HEAVY)  # torch is in sys.modules here
    (tmp_path / "asked.py").write_text("import os, sys\n\n"
                                       "def loaded(name):\n    return name in sys.modules, os.getppid()\n")
    code = """
import concurrent.futures as cf, json, sys
import asked
from octfm import procs

def ask(ctx):
    with cf.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(asked.loaded, "monai.transforms").result()

light = ask(procs.worker_context(preload=("json",)))
heavy = ask(procs.worker_context())
print(json.dumps([light, heavy, "torch" in sys.modules]))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert r.returncode == 0, r.stderr[-2000:]
    light, heavy, torch_here = json.loads(r.stdout.strip().splitlines()[-1])
    assert light[0] is False and not torch_here     # the light server: no MONAI
    assert heavy[0] is True and heavy[1] != light[1]  # a loader's: a new server, with MONAI

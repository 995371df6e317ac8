"""Volumes resident on the device (train/resident.py, `data.resident`): the device-side crop is the
production transform's crop for the same box, the loader's other draws are unchanged, and a
training runs through it (on the CPU here: the GPU-size learning check's dry run takes this path)."""
import numpy as np
import pytest
import torch

from conftest import tiny_train_args, train_here
from train import data, masks, resident
from octfm import config
from train.config import DataConfig, MaskConfig, TrainConfig


def test_a_resident_crop_is_the_box_resized_as_monai_resizes_it():
    from monai.transforms import Resize

    vols = torch.randint(0, 256, (3, 16, 40, 40), dtype=torch.uint8)
    res = resident.ResidentVolumes.__new__(resident.ResidentVolumes)
    res.volumes = vols
    shape = (12, 32, 32)
    boxes = torch.tensor([[2, 3, 5, 12, 32, 32], [0, 1, 0, 10, 27, 30], [4, 0, 8, 12, 29, 26]], dtype=torch.int32)
    out = res.crops(torch.tensor([2, 0, 1]), boxes, torch.tensor([False, True, False]), shape)
    assert out.dtype == torch.uint8 and out.shape == (3, 1, *shape)
    assert torch.equal(out[0, 0], vols[2, 2:14, 3:35, 5:37])                     # a box of the shape: copied
    for j, (i, b, flip) in enumerate(((0, boxes[1], True), (1, boxes[2], False))):
        box = vols[i, b[0]:b[0] + b[3], b[1]:b[1] + b[4], b[2]:b[2] + b[5]][None].float()
        want = torch.as_tensor(Resize(shape, mode="trilinear")(box)).round().clamp(0, 255).to(torch.uint8)[0]
        want = want.flip(-1) if flip else want
        assert (out[j + 1, 0].int() - want.int()).abs().max() <= 1  # float rounding at .5 only


def test_boxes_stay_inside_and_follow_the_scale():
    rng = np.random.default_rng(0)
    boxes = np.stack([data.draw_box(rng, (20, 64, 64), (16, 48, 48), (0.8, 1.0), True) for _ in range(300)])
    start, size = boxes[:, :3], boxes[:, 3:]
    assert (start >= 0).all() and (start + size <= [20, 64, 64]).all()
    assert size.min(0).tolist() == [13, 38, 38] and size.max(0).tolist() == [16, 48, 48]
    fixed = data.draw_box(rng, (20, 64, 64), (16, 48, 48), (0.8, 1.0), False)
    assert fixed[3:].tolist() == [16, 48, 48]


def test_without_volumes_the_items_keep_their_masks_and_jitter(tiny_cache):
    rows = data.select_rows(str(tiny_cache), ["train"], None)
    cfg = DataConfig(cache=str(tiny_cache), input_shape=(16, 48, 48), scale=(0.8, 1.0))
    mcfg = MaskConfig()
    grid = masks.grid_for(cfg.input_shape, (4, 16, 16))
    sizes = masks.calibrate(grid, mcfg, seed=0)
    with_x = data.CacheDataset(rows, cfg, mcfg, grid, sizes, seed=3)[(1, 2)]
    boxed = data.CacheDataset(rows, cfg, mcfg, grid, sizes, seed=3, volumes=False)[(1, 2)]
    assert set(with_x) - set(boxed) == {"x"} and set(boxed) - set(with_x) == {"index", "box", "flip"}
    for k in with_x:
        if k != "x":
            assert torch.equal(with_x[k], boxed[k]), k
    assert int(boxed["index"]) == 2 and boxed["box"][3:].ge(torch.tensor([12, 38, 38])).all()


def test_a_training_runs_on_resident_volumes(tiny_cache, tmp_path, capsys):
    from train import pretrain

    seen = []
    real = pretrain.Trainer.materialize

    def spy(self, batch):
        out = real(self, batch)
        seen.append((self.resident is not None, tuple(out["x"].shape), out["x"].dtype))
        return out

    pretrain.Trainer.materialize = spy
    try:
        train_here(*tiny_train_args(tiny_cache, tmp_path, name="r", max_steps=3, ckpt_every=3,
                                    **{"data.resident": "always", "data.workers": 1, "data.scale": "[0.8,1.0]"}))
    finally:
        pretrain.Trainer.materialize = real
    assert seen == [(True, (4, 1, 16, 48, 48), torch.uint8)] * 3
    assert (tmp_path / "r" / "checkpoints").exists()
    # its startup record: the loader (whose worker starts there) before the volumes load, and the
    # worker forked and ready before the first batch came (docs/accelerators.md, the H200's 89 s)
    import json

    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    (st,) = [r for r in recs if r["split"] == "startup"]
    laps = [k for k in st if k.endswith("_s") and k != "total_s"]
    assert laps == ["loader_s", "resident_s", "online_probe_s", "first_batch_s", "first_update_s"]
    assert st["workers_ready"] == 1
    first_batch_at = sum(st[k] for k in laps[:4])
    assert 0 <= st["workers_last_forked_at"] <= st["workers_first_ready_at"] <= first_batch_at + 0.01, st


def test_a_finished_run_starts_no_loader(tiny_cache, tmp_path, monkeypatch):
    """Re-entering a finished run (the learning check does, each time it resumes) builds no loader
    and so starts no workers; it loads no resident volumes either."""
    from train import pretrain

    args = tiny_train_args(tiny_cache, tmp_path, name="done", max_steps=2, ckpt_every=2,
                           **{"data.resident": "always", "data.workers": 1})
    train_here(*args)
    calls = []
    monkeypatch.setattr(pretrain.Trainer, "loader", lambda self, *a, **k: calls.append("loader"))
    monkeypatch.setattr(pretrain.Trainer, "load_resident", lambda self, progress: calls.append("resident"))
    train_here(*args)
    assert calls == []


def test_auto_keeps_the_loader_off_cuda():
    rows = [{"shape": [32, 128, 128]}] * 10
    assert not resident.wanted("auto", torch.device("cpu"), rows, (1, 1, 1))
    assert resident.wanted("always", torch.device("cpu"), rows, (1, 1, 1))
    assert not resident.wanted("never", torch.device("cpu"), rows, (1, 1, 1))
    assert resident.strided_bytes(rows, (2, 2, 2)) == 10 * 16 * 64 * 64
    with pytest.raises(Exception, match="resident"):
        config.from_dict(TrainConfig, {"data": {"resident": "maybe"}})


def _loads_resident(args, monkeypatch) -> bool:
    """Whether a training with `args` cut its crops from resident volumes."""
    from train import pretrain

    took, real = [], pretrain.Trainer.load_resident

    def spy(self, progress):
        took.append(1)
        real(self, progress)
    monkeypatch.setattr(pretrain.Trainer, "load_resident", spy)
    train_here(*args)
    monkeypatch.setattr(pretrain.Trainer, "load_resident", real)
    return bool(took)


def test_a_resume_keeps_the_path_its_run_took(tiny_cache, tmp_path, monkeypatch):
    """The two paths draw different crops for one (seed, epoch, index), so `auto`
    resumes on the path the checkpoint's run took (recorded there), whatever the free memory says
    now; `always` or `never`, set by hand, still decide, and say that the crops change."""
    from train import checkpoint, curves

    monkeypatch.setattr(curves, "plot_metrics", lambda run_dir: None)  # a second of each run's four, not read here
    args = lambda name, mode, steps: tiny_train_args(  # noqa: E731
        tiny_cache, tmp_path, name=name, max_steps=steps, ckpt_every=1, eval_every=0, **{"data.resident": mode})
    assert _loads_resident(args("res", "always", 1), monkeypatch)
    assert checkpoint.load(str(tmp_path / "res" / "checkpoints" / "latest.pt"))["resident"] is True
    assert _loads_resident(args("res", "auto", 2), monkeypatch)      # auto on the CPU alone would say no
    assert not _loads_resident(args("crop", "never", 1), monkeypatch)
    monkeypatch.setattr(resident, "wanted", lambda *a: True)             # as if the card now had the memory
    assert not _loads_resident(args("crop", "auto", 2), monkeypatch)
    assert checkpoint.load(str(tmp_path / "crop" / "checkpoints" / "latest.pt"))["resident"] is False
    said = []                                                            # set by hand: it decides, and says so
    assert resident.on_resume("always", False, torch.device("cpu"), said.append) is None
    assert "data.resident=always" in said[0] and "crops from here differ" in said[0]
    assert resident.on_resume("never", False, torch.device("cpu"), said.append) is None and len(said) == 1


def test_resident_always_on_xla_is_refused_naming_the_key():
    """The resident crop is not built for XLA's sharded batches, so `always` there
    stops the run naming `data.resident` instead of being ignored, as does a resume of a resident
    run under `auto`."""
    from octfm import cli

    rows = [{"shape": [32, 128, 128]}]
    with pytest.raises(cli.UsageError, match="data.resident"):
        resident.wanted("always", torch.device("xla"), rows, (1, 1, 1))
    assert not resident.wanted("auto", torch.device("xla"), rows, (1, 1, 1))
    with pytest.raises(cli.UsageError, match="data.resident=never"):
        resident.on_resume("auto", True, torch.device("xla"), print)


def test_every_process_takes_one_resident_decision(tmp_path):
    """`auto` reads each process's free memory; the run goes resident only when
    every process's volumes fit (Runtime.all_true, an all-reduce), so no rank takes the other path."""
    import subprocess
    import sys

    from conftest import REPO, free_port

    code = ("import sys, torch, torch.distributed as dist; from train import runtime; rank = int(sys.argv[1]); "
            f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=rank, world_size=2); "
            "rt = runtime.Runtime('cpu', torch.device('cpu'), rank=rank, world=2); "
            "print(rt.all_true(rank == 0), rt.all_true(True)); dist.destroy_process_group()")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    assert [p.communicate(timeout=120)[0].split() for p in procs] == [["False", "True"]] * 2
    assert all(p.returncode == 0 for p in procs)

"""`make export`: a model folder that loads in a fresh process without pickle and embeds
cached volumes exactly as the checkpoint does in the probes."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch

from conftest import REPO, run_cli, run_here, train_here
from evals import features
from train import data

# A fresh interpreter in which any unpickling fails: loading must get by with JSON and safetensors.
LOAD_WITHOUT_PICKLE = r"""
import pickle, sys
import numpy as np, torch
def refused(*a, **k):
    raise AssertionError("pickle used while loading an exported encoder")
pickle.loads = pickle.load = torch.load = refused
class NoUnpickler:
    def __init__(self, *a, **k):
        refused()
pickle.Unpickler = NoUnpickler
from train.encoder import load_encoder
enc = load_encoder(sys.argv[1])
assert isinstance(enc, torch.nn.Module) and not enc.training
x = torch.from_numpy(np.load(sys.argv[2]))
out = enc(x)
np.savez(sys.argv[3], pooled=out.pooled.numpy(), tokens=out.tokens.numpy())
"""


def test_export_loads_in_a_fresh_process_and_embeds_like_the_checkpoint(tiny_run, tiny_cache, tmp_path):
    ckpt = tiny_run / "checkpoints" / "step_0000004.pt"
    out = tmp_path / "model"
    r = run_cli("evals.export", "--ckpt", str(ckpt), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "export:" in r.stdout and "load_encoder" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]

    conf = json.loads((out / "config.json").read_text())
    assert conf["architecture"]["dim"] == 32 and conf["architecture"]["tubelet"] == [4, 16, 16]
    assert conf["input"]["input_shape"] == [16, 48, 48] and conf["input"]["grid"] == [4, 3, 3]
    assert conf["normalization"] == {"formula": "(x / 255 - mean) / std", "mean": data.PIXEL_MEAN, "std": data.PIXEL_STD}
    assert conf["training"]["step"] == 4
    assert conf["cache"]["stored_shape"] == [16, 64, 64]
    assert conf["cache"]["preprocess"]["target_shape"] == [16, 64, 64]
    assert conf["cache"]["preprocess"]["percentiles"] == [1.0, 99.0]
    card = (out / "README.md").read_text()
    assert "step 4 of 4" in card and "| study_group | pretrained | linear |" in card  # tiny_run was probed

    # the probes' features of the same volumes, from the checkpoint
    enc, cfg, _ = features.checkpoint_encoder(str(ckpt))
    rows = [r for r in data.select_rows(str(tiny_cache), ["train", "val", "test"], None)][:3]
    ref = features.extract(enc, cfg, rows, str(tiny_cache), (1, 1, 1))
    from cache import store

    vols = np.stack([store.read_volume(str(tiny_cache), r["volume"]) for r in rows])
    np.save(tmp_path / "x.npy", vols)
    p = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PICKLE, str(out), str(tmp_path / "x.npy"),
                        str(tmp_path / "emb.npz")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = np.load(tmp_path / "emb.npz")
    assert got["pooled"].shape == (3, 32) and got["tokens"].shape == (3, 36, 32)
    np.testing.assert_allclose(got["pooled"], ref["pooled"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["tokens"], ref["tokens"].astype(np.float32), rtol=0, atol=2e-3)  # stored as fp16
    with torch.no_grad():
        assert not torch.equal(torch.from_numpy(got["pooled"][0]), torch.from_numpy(got["pooled"][1]))


def test_make_usage_errors_come_before_the_venv(tmp_path):
    """A missing variable is answered at once, also where no venv exists yet (a fresh clone): the
    check runs before make builds .venv (which took minutes inside make test on a fresh worktree)."""
    import shutil

    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for target, says in (("export", "set CKPT="), ("embed", "set CKPT="), ("pretrain", "set CONFIG="),
                         ("plan", "set CONFIG=")):
        r = subprocess.run(["make", "-s", target], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr, (target, r.stderr)
    assert not (tmp_path / ".venv").exists()


def test_export_names_an_objective_that_is_not_plain_vjepa(tiny_cache, tmp_path):
    """A checkpoint trained with the local term (the learning check's recipe) exports a `loss`
    block and a model card that say so, not "a V-JEPA 3D ViT encoder" alone."""
    from conftest import tiny_train_args

    args = tiny_train_args(tiny_cache, tmp_path / "runs", name="local", max_steps=2, ckpt_every=2,
                           **{"loss.local": 1.0})
    assert "objective: V-JEPA latent prediction + local intensity term" in train_here(*args)
    out = tmp_path / "model"
    r = run_here("evals.export", "--ckpt", str(tmp_path / "runs" / "local" / "checkpoints" / "latest.pt"), "--out", str(out))
    assert r.returncode == 0, r.stderr
    loss = json.loads((out / "config.json").read_text())["loss"]
    assert loss["local"] == 1.0 and "latent" not in loss  # the latent term is always on, at weight 1
    assert loss["objective"] == "V-JEPA latent prediction + local intensity term (tubelet mean cells), weights 1 / 1"
    card = (out / "README.md").read_text()
    assert "a V-JEPA 3D ViT encoder" not in card and f"Pretrained with: {loss['objective']}." in card

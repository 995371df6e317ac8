"""`make embed`: a pandas table with one row per cached volume and its pooled embedding;
reuses the probes' features, a killed run resumes from the chunks it wrote (its own
checkpoint's only), a second run on the same output is refused while the first lives, and a
split leak in the manifest does not stop it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import torch

from conftest import REPO, keys_after_edits, run_cli, run_here
from cache import store
from evals import features
from octfm import config, fsio
from train import data, encoder

KEYS = ["participant_id", "device", "laterality", "anatomic_region", "imaging", "split", "label"]


def probed_checkpoint(run) -> str:
    """The checkpoint `make probe run=<run>` probed, spelled otherwise than the probe spelled it:
    its features are keyed by the checkpoint's identity, not the path, so they are reused all the same."""
    return f"{run}/checkpoints/./step_0000004.pt"


def expected_embeddings(ckpt: str, cache, rows) -> np.ndarray:
    enc, cfg, _ = features.checkpoint_encoder(ckpt)
    model = encoder.wrap(enc, cfg.data.stride, cfg.data.input_shape)
    x = torch.from_numpy(np.stack([store.read_volume(str(cache), r["volume"]) for r in rows]))
    return model(x).pooled.numpy()


def test_embeddings_table_reuses_probe_features_and_reads_in_pandas(tiny_run, tiny_cache, tmp_path):
    ckpt = probed_checkpoint(tiny_run)
    out = tmp_path / "embeddings.parquet"
    # as a user runs it; the other runs here go in this process (conftest.run_here), except where two must live
    r = run_cli("evals.embed", "--ckpt", ckpt, "--out", str(out), "--chunk", "7", "--no-progress")
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(out)
    rows = data.select_rows(str(tiny_cache), ["train", "val", "test"], None)
    assert len(df) == len(rows) and list(df.relpath) == [r["relpath"] for r in rows]
    assert f"{len(rows)} from the probes' features" in r.stdout, r.stdout  # tiny_run was probed; all labelled
    assert set(KEYS) <= set(df.columns) and df.label.notna().all() and str(df.label.dtype) == "Int64"
    emb = np.stack(df.embedding.to_numpy())
    assert emb.shape == (len(rows), 32) and emb.dtype == np.float32
    np.testing.assert_allclose(emb[:4], expected_embeddings(ckpt, tiny_cache, rows[:4]), atol=1e-5, rtol=0)
    print(df[KEYS + ["embedding"]].head())

    again = run_here("evals.embed", "--ckpt", ckpt, "--out", str(out), "--no-progress")
    assert again.returncode == 0 and f"0 embedded, 0 from the probes' features, {len(rows)} already done" in again.stdout


def test_bf16_embeddings_are_their_own_table_close_to_float32(tiny_run, tiny_cache, tmp_path):
    """--precision bf16 (the default on CUDA) runs the encoder under bf16 autocast (here on the
    CPU): close to the float32 embeddings, not equal to them, and keyed apart, so neither the
    probes' float32 features nor a float32 table's chunks are taken for it."""
    ckpt = probed_checkpoint(tiny_run)
    rows = data.select_rows(str(tiny_cache), ["train", "val", "test"], None)
    out = tmp_path / "bf16.parquet"
    r = run_here("evals.embed", "--ckpt", ckpt, "--out", str(out), "--precision", "bf16", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"{len(rows)} embedded, 0 from the probes' features" in r.stdout, r.stdout
    emb = np.stack(pd.read_parquet(out).embedding.to_numpy())
    ref = expected_embeddings(ckpt, tiny_cache, rows)
    assert emb.dtype == np.float32 and not np.array_equal(emb, ref)
    rel = np.linalg.norm(emb - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel.max() < 0.05, rel.max()
    enc, cfg, ident = features.checkpoint_encoder(ckpt)
    keys = {p: features.feature_key(ident, rows, cfg, (1, 2, 2), p) for p in ("fp32", "bf16")}
    assert keys["fp32"] != keys["bf16"]
    assert features.resolve_precision("auto", "cuda") == "bf16" and features.resolve_precision("auto", "cpu") == "fp32"


def test_a_killed_embed_resumes_from_its_chunks(tiny_run, tiny_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    ckpt = str(tiny_run / "checkpoints" / "step_0000002.pt")  # not probed: every volume is embedded
    rows = data.select_rows(str(cache), ["train", "val", "test"], None)
    # a volume whose chunk is a FIFO: reading it blocks, so the run is stuck there until killed
    chunk = next((cache / rows[5]["volume"] / "0" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    saved = chunk.read_bytes()
    chunk.unlink()
    os.mkfifo(chunk)
    out = tmp_path / "emb.parquet"
    args = [sys.executable, "-m", "evals.embed", "--ckpt", ckpt, "--cache", str(cache), "--out", str(out),
            "--chunk", "2", "--batch", "1", "--no-progress"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts = tmp_path / "emb.parquet.parts"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(parts.rglob("chunk-*.parquet"))) < 2:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.5)
    assert proc.poll() is None, "the run was expected to block on the FIFO volume"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert len(list(parts.rglob("chunk-*.parquet"))) == 2 and not out.exists()  # rows 0-3 written, row 5 blocked

    chunk.unlink()
    chunk.write_bytes(saved)
    r = run_here("evals.embed", "--ckpt", ckpt, "--cache", str(cache), "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"{len(rows) - 4} embedded, 0 from the probes' features, 4 already done" in r.stdout, r.stdout
    assert not parts.exists()
    df = pd.read_parquet(out)
    assert list(df.relpath) == [r["relpath"] for r in rows]
    np.testing.assert_allclose(np.stack(df.embedding.to_numpy()), expected_embeddings(ckpt, cache, rows),
                               atol=1e-5, rtol=0)


def test_chunks_another_checkpoint_left_are_not_taken(tiny_run, tiny_cache, tmp_path):
    """A run of checkpoint A killed with its chunks on disk, then B on the same output: B's
    table holds B's vectors (before: A's, under B's key)."""
    from evals import embed

    a_ckpt, b_ckpt = str(tiny_run / "checkpoints" / "step_0000002.pt"), str(tiny_run / "checkpoints" / "step_0000004.pt")
    a_table = tmp_path / "a.parquet"
    assert run_here("evals.embed", "--ckpt", a_ckpt, "--out", str(a_table), "--no-progress").returncode == 0
    out = tmp_path / "emb.parquet"
    parts = tmp_path / "emb.parquet.parts"
    _, cfg, ident = features.checkpoint_encoder(b_ckpt)
    b_key = embed.embed_key(ident, cfg, cfg.data.cache)
    for where in (parts, parts / b_key):  # where a killed A left chunks: the old layout, and mislabelled under B's key
        where.mkdir(parents=True, exist_ok=True)
        shutil.copy(a_table, where / "chunk-00000.parquet")
    r = run_here("evals.embed", "--ckpt", b_ckpt, "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    rows = data.select_rows(str(tiny_cache), ["train", "val", "test"], None)
    df = pd.read_parquet(out)
    np.testing.assert_allclose(np.stack(df.embedding.to_numpy())[:4], expected_embeddings(b_ckpt, tiny_cache, rows[:4]),
                               atol=1e-5, rtol=0)
    assert "written with another key; not reused" in r.stderr


def test_a_second_run_on_the_same_output_is_refused_while_the_first_lives(tiny_run, tmp_path):
    ckpt = str(tiny_run / "checkpoints" / "step_0000004.pt")
    out = tmp_path / "emb.parquet"
    lock = tmp_path / "emb.parquet.lock"
    with fsio.pid_lock(lock):                              # a live holder: this test's process
        r = run_cli("evals.embed", "--ckpt", ckpt, "--out", str(out), "--no-progress")
    assert r.returncode == 2 and "another make embed is writing it" in r.stderr and str(os.getpid()) in r.stderr
    assert not out.exists()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock.write_text(str(gone.pid))                          # a killed run's lock
    r = run_here("evals.embed", "--ckpt", ckpt, "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"taking over the lock of pid {gone.pid}" in r.stderr and out.exists() and not lock.exists()


def test_a_split_leak_does_not_stop_embedding(tiny_run, tiny_cache, tmp_path):
    """Embedding trains nothing, so a participant in two splits (which the probes refuse) is
    embedded like any other; the probes' features are still reused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    part = next((cache / "manifest.parquet").glob("*.parquet"))
    t = pq.read_table(part).to_pandas()
    who = t[t.split == "train"].participant_id.iloc[0]
    first = t.index[t.participant_id == who][0]
    t.loc[first, "split"] = "test"                          # one of their volumes in test, the rest in train
    pq.write_table(pa.Table.from_pandas(t, schema=pq.read_schema(part), preserve_index=False), part)
    ckpt = probed_checkpoint(tiny_run)
    r = run_here("evals.embed", "--ckpt", ckpt, "--cache", str(cache), "--out", str(tmp_path / "e.parquet"),
                "--no-progress")
    assert r.returncode == 0, r.stderr
    rows = data.select_rows(str(cache), ["train", "val", "test"], None)
    assert len(pd.read_parquet(tmp_path / "e.parquet")) == len(rows)


def test_kept_features_embeddings_and_leaderboard_rows_are_keyed_on_their_code(tmp_path, monkeypatch):
    """An edit to the model's code (the bf16 residual stream changed the pooled features) makes the
    features, the embeddings and the leaderboard's stored rows afresh: their keys change; an edit
    to a file none of them imports keeps them."""
    from evals import embed, features, leaderboard
    from evals.config import ProbeConfig
    from train.config import TrainConfig

    ident, cfg = {"step": 2, "name": "step_0000002.pt"}, TrainConfig()
    rows = [{"relpath": "a.dcm", "cache_key": "k"}]

    def keys() -> tuple[str, str, str]:
        return (features.feature_key(ident, rows, cfg, (1, 2, 2)), embed.embed_key(ident, cfg, "c"),
                leaderboard.settings_key(ProbeConfig()))

    packages = {f.split("/")[0] for f in config.import_closure("evals/probe.py", "train/plan.py")}
    before, plan_edited, after = keys_after_edits(tmp_path, monkeypatch, packages, keys,
                                                  ["train/plan.py", "train/model.py"])
    assert plan_edited == before
    assert [a != b for a, b in zip(after, before)] == [True, True, True], (before, after)

"""`make embed CKPT=... [CACHE=...]`: one row per cached volume with its manifest keys and the
frozen encoder's pooled embedding, in `<run>/embeddings.parquet`.

So a user needs `pd.read_parquet` and a join with participants.tsv, nothing of this code.
Streamed: volumes are embedded a batch at a time and written in chunks of `--chunk` rows
under `<out>.parts/<key>/` (the key names the checkpoint, cache and settings, and each chunk
carries it), so memory does not grow with the cache and a killed run resumes from the chunks
it wrote with the same key only; the table is then assembled chunk by chunk. A lock file
`<out>.lock` refuses a second run on the same output while the first is alive. Volumes the
probes already embedded (the feature cache of `make probe` for this checkpoint) are taken
from there.
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from cache import store
from evals import features, probe
from evals.config import ProbeConfig
from manifests import schema
from manifests.aireadi import SPLITS
from octfm import cli, config, fsio
from train import data, encoder, runtime, shares
from train.run_folder import RunFolder

KEYS = ("participant_id", "device", "laterality", "anatomic_region", "imaging", "split", "label",
        "sop_instance_uid", "relpath", "volume", "cache_key")
KEY_META = b"octfm_embed_key"


def table_schema(dim: int, key: str) -> pa.Schema:
    fields = [pa.field(k, pa.int8() if k == "label" else pa.string()) for k in KEYS]
    out = schema.with_nullable_ints(fields + [pa.field("embedding", pa.list_(pa.float32(), dim))])
    return out.with_metadata({**out.metadata, KEY_META: key.encode()})


def embed_key(ident: dict, cfg, cache: str, precision: str = "fp32") -> str:
    """What the embeddings depend on besides each volume's cache key."""
    blob = {"encoder": ident, "cache": cache, "stride": list(cfg.data.stride), "input": list(cfg.data.input_shape),
            "pooling": cfg.model.pool, "code": features.feature_code_key()}
    if precision != "fp32":
        blob["precision"] = precision
    return config.content_key(blob)


def embedding_table(rows: list[dict], pooled: np.ndarray, schema: pa.Schema) -> pa.Table:
    cols = {k: [r.get(k) for r in rows] for k in KEYS}
    dim = pooled.shape[1]
    emb = pa.FixedSizeListArray.from_arrays(pa.array(pooled.astype(np.float32).ravel()), dim)
    return pa.Table.from_pydict({**cols, "embedding": emb}, schema=schema)


def has_key(path: Path, key: str) -> bool:
    return (pq.read_schema(path).metadata or {}).get(KEY_META) == key.encode()


def done_tables(out: Path, parts: Path, key: str) -> list[Path]:
    """Files holding rows already embedded with this key: the previous table and this key's
    chunks (a chunk that carries another key is set aside, with a message)."""
    found = []
    for f in sorted(parts.glob("chunk-*.parquet")):
        if has_key(f, key):
            found.append(f)
        else:
            print(f"embed: {f} was written with another key; not reused", file=sys.stderr)
    if out.exists() and has_key(out, key):
        found.insert(0, out)
    return found


def done_keys(files: list[Path]) -> set[tuple[str, str]]:
    keys: set[tuple[str, str]] = set()
    for f in files:
        t = pq.read_table(f, columns=["relpath", "cache_key"])
        keys.update(zip(t.column("relpath").to_pylist(), t.column("cache_key").to_pylist()))
    return keys


def probe_features(ckpt_ident: dict, cfg, run: RunFolder, cache: str,
                   precision: str = "fp32") -> dict[tuple[str, str], np.ndarray]:
    """Pooled features `make probe` already extracted for this checkpoint (its default
    settings, at the same precision), keyed by (relpath, cache_key); empty when there are none."""
    # the probes' rows without their split check: embedding reads volumes, it trains nothing
    rows = data.select_rows(cache, probe.PROBED_SPLITS, None, labelled=True)
    path = run.features / f"{features.feature_key(ckpt_ident, rows, cfg, ProbeConfig().token_pool, precision)}.npz"
    if not rows or not path.exists():
        return {}
    with np.load(path) as z:
        pooled = z["pooled"]
    return {(r["relpath"], r["cache_key"]): pooled[i] for i, r in enumerate(rows)}


def assemble(out: Path, files: list[Path], rows: list[dict], schema: pa.Schema) -> int:
    """Write the table from the done files, a batch at a time, keeping only rows still in the
    cache (rows done earlier first, so volumes added later come last); atomically. Returns
    the number of rows written."""
    want = {(r["relpath"], r["cache_key"]) for r in rows}
    tmp = out.with_name(fsio.temp_name(out.name))
    n = 0
    seen: set = set()
    with pq.ParquetWriter(tmp, schema) as w:
        for f in files:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
                t = pa.Table.from_batches([batch]).cast(schema)
                keys = list(zip(t.column("relpath").to_pylist(), t.column("cache_key").to_pylist()))
                keep = [i for i, k in enumerate(keys) if k in want and k not in seen]
                seen.update(keys[i] for i in keep)
                if keep:
                    w.write_table(t.take(keep))
                    n += len(keep)
    tmp.replace(out)
    return n


def embed(ckpt: str, cache: str | None = None, out: str | None = None, batch: int = 4, chunk: int = 256,
          device: str = "auto", progress: bool = True, precision: str = "auto") -> dict:
    """One output at a time (`<out>.lock`): a second run on it while the first lives is refused.
    `ckpt`: a checkpoint, latest.pt or a run (local or gs://: its newest); `device` auto: the
    accelerator when there is one (train/runtime.py device_for)."""
    device = runtime.device_for(device)
    enc, cfg, ident = features.checkpoint_encoder(ckpt)
    out_path = Path(out) if out else RunFolder(Path(cfg.runs_dir) / cfg.name).embeddings
    out_path.parent.mkdir(parents=True, exist_ok=True)
    lock = out_path.with_name(out_path.name + ".lock")
    try:
        with fsio.pid_lock(lock, on_stale=lambda m: print(f"embed: {m}", file=sys.stderr)):
            return _embed(enc, cfg, ident, cache or shares.whole_cache(cfg.data.cache, "embed"), out_path, batch, chunk,
                          device, progress,
                          features.resolve_precision(precision, device))
    except fsio.Busy as exc:
        raise cli.UsageError(f"--out {out_path}: another make embed is writing it ({exc}); wait for it to "
                             f"finish, or choose another OUT") from None


def _embed(enc, cfg, ident: dict, cache: str, out_path: Path, batch: int, chunk: int, device: str,
           progress: bool, precision: str) -> dict:
    run = RunFolder(Path(cfg.runs_dir) / cfg.name)
    model = encoder.wrap(enc, cfg.data.stride, cfg.data.input_shape).to(device)
    rows = data.select_rows(cache, (*SPLITS, None), None)
    key = embed_key(ident, cfg, cache, precision)
    parts = out_path.with_name(out_path.name + ".parts") / key
    schema = table_schema(cfg.model.dim, key)
    files = done_tables(out_path, parts, key)
    done = done_keys(files)
    todo = [r for r in rows if (r["relpath"], r["cache_key"]) not in done]
    reuse = probe_features(ident, cfg, run, cache, precision) if todo else {}
    parts.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="embed", unit="vol", disable=not progress or not todo, file=sys.stderr)
    reused = 0
    for start in range(0, len(todo), chunk):
        part_rows = todo[start:start + chunk]
        pooled = np.empty((len(part_rows), cfg.model.dim), np.float32)
        miss = []
        for j, r in enumerate(part_rows):
            hit = reuse.get((r["relpath"], r["cache_key"]))
            if hit is None:
                miss.append(j)
            else:
                pooled[j] = hit
        reused += len(part_rows) - len(miss)
        bar.update(len(part_rows) - len(miss))
        for i in range(0, len(miss), batch):
            idx = miss[i:i + batch]
            x = torch.from_numpy(np.stack([store.read_volume(cache, part_rows[j]["volume"]) for j in idx])).to(device)
            with features.autocast(precision, device):
                pooled[idx] = model(x).pooled.float().cpu().numpy()
            bar.update(len(idx))
        name = parts / f"chunk-{len(files):05d}.parquet"
        fsio.write_parquet_atomic(embedding_table(part_rows, pooled, schema), str(name))
        files.append(name)
    bar.close()
    current = {(r["relpath"], r["cache_key"]) for r in rows}
    n = assemble(out_path, files, rows, schema) if todo or done != current or not out_path.exists() else len(rows)
    shutil.rmtree(parts, ignore_errors=True)
    with contextlib.suppress(OSError):
        parts.parent.rmdir()  # when no other key's chunks wait there
    return {"out": str(out_path), "rows": n, "embedded": len(todo) - reused, "from_probe_features": reused,
            "already_done": len(rows) - len(todo), "dim": cfg.model.dim, "cache": cache, "precision": precision,
            "device": device}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make embed", description=__doc__)
    ap.add_argument("--ckpt", required=True, help="a training checkpoint, or a run (its newest; local or gs://)")
    ap.add_argument("--cache", default=None, help="default: the cache the checkpoint was trained on")
    ap.add_argument("--out", default=None, help="default: <run>/embeddings.parquet")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256, help="rows per resumable chunk")
    ap.add_argument("--device", default="auto", help="auto: the accelerator when there is one, else cpu")
    ap.add_argument("--precision", choices=features.PRECISIONS, default="auto",
                    help="auto: bf16 autocast on cuda, float32 elsewhere")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if a.batch < 1 or a.chunk < 1:
        raise cli.UsageError("--batch and --chunk must be at least 1")
    t0 = time.perf_counter()
    res = embed(a.ckpt, a.cache, a.out, a.batch, a.chunk, a.device, progress=not a.no_progress, precision=a.precision)
    print(f"embed: {res['rows']} volumes of {res['cache']} -> {res['out']} (embedding dim {res['dim']}, on "
          f"{res['device']}): "
          f"{res['embedded']} embedded, {res['from_probe_features']} from the probes' features, "
          f"{res['already_done']} already done; {time.perf_counter() - t0:.1f}s")
    print(f"embed: import pandas as pd; df = pd.read_parquet({res['out']!r})")
    return 0


if __name__ == "__main__":
    cli.run(main)

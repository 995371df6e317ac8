"""`make export CKPT=... OUT=...`: a training checkpoint -> a model folder others can load.

The folder holds the EMA target encoder (the one V-JEPA evaluates and the probes use) as
`model.safetensors`, a `config.json` that rebuilds it with `train.encoder.load_encoder`
(architecture, input shape and stride, tubelet, intensity normalisation, the preprocessing
of the cache it was trained on, code versions), and a model card `README.md`.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Sequence

from cache import store
from evals import features
from ingest import preprocess as prep
from manifests import paths
from octfm import cli, config, fsio, procs
from train import checkpoint, data, encoder, shares
from train.config import TrainConfig
from train.model import objective
from train.run_folder import RunFolder

REPO = Path(__file__).resolve().parents[1]


def code_version() -> dict:
    """The package version, the git commit when run from a clone, and the cache code version."""
    return {"octfm": metadata.version("octfm"), "git": procs.git_commit(REPO), "cache_code_version": prep.CODE_VERSION}


def cache_provenance(cache: str, cfg: TrainConfig) -> dict:
    """What the encoder was trained on: the cache's code version, stored shape and preprocessing
    parameters (from a volume's attributes), and the training volumes per scanner."""
    try:
        rows = paths.read_manifest_table(cache).to_pylist()
    except (FileNotFoundError, OSError) as exc:
        print(f"export: warning: cannot read the cache manifest under {cache} ({exc}); config.json records no "
              "preprocessing parameters", flush=True)
        return {"uri": cache, "readable": False}
    ok = [r for r in rows if r["status"] == "ok"]
    trained = [r for r in ok if r["split"] in cfg.data.splits and (cfg.data.scanners is None or r["device"] in cfg.data.scanners)]
    attrs = store.read_attrs(cache, ok[0]["volume"]) if ok else None
    return {
        "uri": cache, "readable": True,
        "code_version": sorted({r["code_version"] for r in ok}),
        "stored_shape": sorted({tuple(r["shape"]) for r in ok})[0] if ok else None,
        "preprocess": (attrs or {}).get("preprocess"),
        "training_volumes": dict(sorted(Counter(r["device"] for r in trained).items())),
    }


def encoder_config(cfg: TrainConfig, step: int, ckpt: str, cache: dict, grid) -> dict:
    """config.json: everything load_encoder needs, and where the weights came from."""
    model = config.to_dict(cfg.model)
    return {
        "format": encoder.FORMAT, "format_version": encoder.FORMAT_VERSION,
        "architecture": {"type": "vit3d", **{k: model[k] for k in encoder.ARCH_KEYS},
                         "positions": "fixed 3D sin-cos", "attention": "PyTorch SDPA", "final_norm": "LayerNorm"},
        "input": {"dtype": "uint8", "axes": "B, D, H, W (cached volumes)", "stride": list(cfg.data.stride),
                  "crop": "centre", "input_shape": list(cfg.data.input_shape), "grid": list(grid)},
        "normalization": {"formula": "(x / 255 - mean) / std", "mean": data.PIXEL_MEAN, "std": data.PIXEL_STD},
        "pooling": f"{cfg.model.pool} over tokens",
        "loss": {**config.to_dict(cfg.loss), "objective": objective(cfg.loss)},
        "cache": cache,
        "training": {"run": cfg.name, "step": step, "checkpoint": ckpt, "max_steps": cfg.max_steps,
                     "global_batch": cfg.global_batch, "splits": cfg.data.splits, "scanners": cfg.data.scanners},
        "code": code_version(),
    }


def probe_results(cfg: TrainConfig, step: int) -> tuple[str, dict[str, dict]]:
    """Probe results for this step: the leaderboard's record of it, else the run's last `make
    probe` (which names no step). Returns (where they came from, {task: result})."""
    run = RunFolder(Path(cfg.runs_dir) / cfg.name)
    board = run.stored_result(step)
    if board.exists():
        return f"{board} (this step)", json.loads(board.read_text())["result"]["results"]
    found = {p.parent.name: json.loads(p.read_text()) for p in sorted(run.probe.glob("*/metrics.json"))}
    return (f"{run.probe}/<task>/metrics.json (the run's last `make probe`)", found) if found else ("", {})


def finetune_results(ckpt: str, task: str) -> tuple[str, dict[str, dict]]:
    """A fine-tuning run's test report (<run>/checkpoints/best.pt -> <run>/<task>/metrics.json)."""
    path = Path(ckpt).parent.parent / task / "metrics.json"
    return (str(path), {task: json.loads(path.read_text())}) if path.exists() else ("", {})


def model_card(conf: dict, probes: tuple[str, dict]) -> str:
    t, a, c = conf["training"], conf["architecture"], conf["cache"]
    vols = c.get("training_volumes") or {}
    lines = [
        f"# {t['run']}: a 3D ViT encoder for retinal OCT (octfm)", "",
        f"Pretrained with: {conf['loss']['objective']}.", "",
        "```python", "from train.encoder import load_encoder", "enc = load_encoder('<this folder>')",
        "out = enc(volumes)  # uint8 [B, D, H, W] cached volumes -> out.pooled [B, dim], out.tokens [B, N, dim]", "```",
        "",
        f"- Weights: the EMA target encoder at step {t['step']} of {t['max_steps']} (global batch "
        f"{t['global_batch']}), from `{t['checkpoint']}`.",
        f"- Architecture: ViT, dim {a['dim']}, depth {a['depth']}, {a['heads']} heads, tubelet {a['tubelet']}, "
        f"input {conf['input']['input_shape']} (stride {conf['input']['stride']}, centre crop), "
        f"token grid {conf['input']['grid']}.",
        f"- Data: the cache `{c['uri']}` (code version {c.get('code_version')}, stored shape {c.get('stored_shape')}), "
        f"splits {t['splits']}, scanners {t['scanners'] or 'all'}; training volumes per scanner: "
        f"{', '.join(f'{d} {n}' for d, n in vols.items()) or 'unknown'}.",
        f"- Intensities: {conf['normalization']['formula']} with mean {conf['normalization']['mean']}, std "
        f"{conf['normalization']['std']}; the cache's preprocessing is in config.json (`cache.preprocess`).",
        f"- Code: octfm {conf['code']['octfm']}, commit {conf['code']['git']}.", "",
        "## Probe results (frozen encoder, diabetes status)", "",
    ]
    if "head" in conf:
        h = conf["head"]
        lines[2:2] = [f"Fine-tuned end to end for `{h['task']}` ({', '.join(h['classes'])}) with a {h['kind']} head "
                      f"(`{h['file']}`; best val epoch {h['best_epoch']}, val balanced accuracy "
                      f"{h['val']['balanced_accuracy']:.3f}); class probabilities: "
                      "`from evals.probe_heads import load_classifier; load_classifier('<this folder>')(volumes)`.", ""]
    where, results = probes
    if not results:
        return "\n".join(lines + ["No probe results were found for this run (`make probe`, `make leaderboard`).", ""])
    lines += [f"From {where}.", "", "| task | encoder | head | test balanced accuracy | test AUROC |", "|---|---|---|---|---|"]
    for task, res in results.items():
        for p in res["probes"]:
            m = p["test"]
            lines.append(f"| {task} | {p['encoder']} | {p['head']} | {m['balanced_accuracy']:.3f} | "
                         f"{m.get('auroc_macro_ovr', float('nan')):.3f} |")
    return "\n".join(lines + [""])


def export(ckpt: str, out: str, cache: str | None = None) -> dict:
    """Write the model folder `out` (local or gs://); each file atomically. Returns config.json."""
    from safetensors.torch import save

    path, st = checkpoint.load_named(ckpt)
    enc, cfg, ident = features.checkpoint_encoder(path, state=st)
    cache = cache or shares.whole_cache(cfg.data.cache, "export")
    conf = encoder_config(cfg, ident["step"], ckpt, cache_provenance(cache, cfg), enc.grid)
    weights = save({k: v.contiguous() for k, v in enc.state_dict().items()}, metadata={"format": encoder.FORMAT})
    fsio.atomic_write_bytes(fsio.join(out, encoder.WEIGHTS_FILE), weights)
    if "finetune" in st:  # a `make finetune` best epoch: its task head beside the encoder
        ft = st["finetune"]
        conf["head"] = {"file": encoder.HEAD_FILE, "kind": ft["head"], "task": ft["task"], "classes": ft["classes"],
                        "token_pool": ft["token_pool"], "best_epoch": int(st["step"]), "val": ft["best"],
                        "fine_tuned_from": ft["from"]}
        head = save({k: v.contiguous() for k, v in st["head"].items()}, metadata={"format": encoder.FORMAT})
        fsio.atomic_write_bytes(fsio.join(out, encoder.HEAD_FILE), head)
    fsio.atomic_write_bytes(fsio.join(out, encoder.CONFIG_FILE), json.dumps(conf, indent=2).encode())
    probes = finetune_results(ckpt, conf["head"]["task"]) if "head" in conf else probe_results(cfg, ident["step"])
    fsio.atomic_write_bytes(fsio.join(out, "README.md"), model_card(conf, probes).encode())
    return conf


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make export", description=__doc__)
    ap.add_argument("--ckpt", required=True, help="a training checkpoint, or a run (its newest; local or gs://)")
    ap.add_argument("--out", required=True, help="the model folder to write")
    ap.add_argument("--cache", default=None, help="the cache it was trained on (default: the checkpoint's data.cache)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    conf = export(a.ckpt, a.out, a.cache)
    arch = conf["architecture"]
    print(f"export: {a.ckpt} (step {conf['training']['step']}) -> {a.out}: {encoder.WEIGHTS_FILE} (dim {arch['dim']}, "
          f"depth {arch['depth']}, grid {conf['input']['grid']}; pretrained with {conf['loss']['objective']}), "
          f"{encoder.CONFIG_FILE}, README.md in "
          f"{time.perf_counter() - t0:.1f}s. Load it with: from train.encoder import load_encoder; "
          f"load_encoder({a.out!r})")
    return 0


if __name__ == "__main__":
    cli.run(main)

"""`python -m bench.step_ops [--config ...] [k=v ...]`: what one eager training step dispatches.

Counts, per step, under torch.profiler on the CPU: every aten call; the leaf calls that compute
(no aten op beneath them, views and metadata aside), each of which is a kernel launch on a GPU;
the dtype casts among them; and the LayerNorms and residual adds that run in float32 under bf16
autocast. A step the host sets the pace of (the check's on the H200, docs/accelerators.md) costs
about its launches, so this is the count to bring down; it needs no GPU and does not depend on
the batch. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

# ops that only describe memory (no kernel on a GPU)
METADATA = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::permute", "aten::transpose", "aten::t",
            "aten::expand", "aten::select", "aten::slice", "aten::as_strided", "aten::unsqueeze", "aten::squeeze",
            "aten::detach", "aten::alias", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh",
            "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view", "aten::unflatten", "aten::flatten",
            "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::contiguous",
            "aten::result_type", "aten::is_nonzero", "aten::_has_compatible_shallow_copy_type", "aten::set_",
            "aten::view_as", "aten::expand_as", "aten::narrow", "aten::numpy_T", "aten::_local_scalar_dense",
            "aten::item", "aten::detach_", "aten::_to_dense", "aten::to", "aten::type_as"}
CASTS = {"aten::_to_copy"}


def _grouped(e) -> bool:
    """Inside a multi-tensor op (foreach, fused AdamW): one or a few kernels on a GPU, whatever
    the CPU build dispatches beneath it per tensor."""
    e = e.cpu_parent
    while e is not None:
        if e.name.startswith(GROUPS):
            return True
        e = e.cpu_parent
    return False


GROUPS = ("aten::_foreach_", "aten::_fused_adam")


def count(events, steps: int) -> dict:
    """Per-step counts from a profile's events (FunctionEvents with parents and children)."""
    aten = [e for e in events if e.name.startswith("aten::")]
    launches = []
    for e in aten:
        if _grouped(e):
            continue
        if e.name.startswith(GROUPS):  # the outermost multi-tensor op: one launch (a few, per chunk, on CUDA)
            launches.append(e)
        elif e.name not in METADATA and not any(c.name.startswith("aten::") for c in e.cpu_children):
            launches.append(e)
    by_name = Counter(e.name for e in launches)
    fp32_norms = sum(1 for e in aten if e.name == "aten::native_layer_norm" and _first_dtype(e) == "float")
    fp32_adds = sum(1 for e in aten if e.name == "aten::add" and _first_dtype(e) == "float" and not _grouped(e))
    return {"aten_calls_per_step": len(aten) / steps, "launches_per_step": len(launches) / steps,
            "casts_per_step": sum(1 for e in aten if e.name in CASTS and not _grouped(e)) / steps,
            "float32_layer_norms_per_step": fp32_norms / steps, "float32_adds_per_step": fp32_adds / steps,
            "top_launches": [[k, v / steps] for k, v in by_name.most_common(12)]}


def _first_dtype(e) -> str | None:
    types = getattr(e, "input_dtypes", None) or []
    return types[0] if types else None


def count_step(config_path: str, overrides: list[str], steps: int = 2) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from octfm import config
    from train import pretrain, runtime
    from train.config import TrainConfig

    cfg = config.load(TrainConfig, config_path, ["device=cpu", "data.workers=0", "wandb.enabled=false", *overrides])
    tr = pretrain.Trainer(cfg, runtime.setup("cpu", cfg.precision))
    _, dl = tr.loader(tr.rows, 0, augment=True, shuffle=True, seed=0)
    it = iter(dl)
    batches = [next(it) for _ in range(steps)]
    for b in batches:  # warm
        tr.advance_schedules()
        tr.update([b], tr.model)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        for b in batches:
            tr.advance_schedules()
            tr.update([b], tr.model)
    out = count(p.events(), steps)
    out.update(config=config_path, overrides=overrides, precision=cfg.precision, torch=torch.__version__)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_ops", description=__doc__)
    ap.add_argument("--config", default="configs/pretrain_check_gpu.yaml")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="key=value (data.cache=... is needed)")
    a = ap.parse_args(argv)
    print(json.dumps(count_step(a.config, a.overrides, a.steps)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())

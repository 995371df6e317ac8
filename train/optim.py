"""The optimizer and its guarded step: AdamW's parameter groups and flags per backend, its state
created before the first update and loaded from a checkpoint saved on any backend, and the update
that leaves everything as it was when the update guard (train/guard.py) refuses it. Pretraining
(train/pretrain.py) and fine-tuning (evals/finetune.py) both step with it.
"""
from __future__ import annotations

import torch

from train import runtime
from train.config import TrainConfig


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay applies to weights, not to biases, norms and the mask token (1-D parameters,
    and biases kept per head, such as a probe head's `b` [heads, classes])."""
    return p.ndim > 1 and not name.endswith("mask_token") and name.rsplit(".", 1)[-1] not in ("b", "bias")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: with and without weight decay (`decays`)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_flags(kind: str) -> dict:
    """AdamW flags for a device-tensor lr. Fused on the CPU and CUDA: one kernel over every
    parameter (on a CPU ViT-S step 6x faster than the per-tensor loop, docs/measurements.md), and
    it skips a refused update exactly through `found_inf` (guarded_step). XLA: capturable, so the
    step count lives on the device where the guard can select it without a host sync."""
    if kind == "xla":
        return {"foreach": False, "capturable": True}
    return {"fused": True}


def build_optimizer(model, cfg: TrainConfig, rt: runtime.Runtime, lr: torch.Tensor):
    """AdamW with a device-tensor lr shared by its groups (optimizer_flags), its state created."""
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=lr, betas=tuple(cfg.optim.betas),
                            **optimizer_flags(rt.kind))
    init_optimizer_state(opt)
    return opt


OPTIMIZER_FLAGS = ("capturable", "foreach", "fused")  # chosen per backend by build_optimizer


def load_optimizer(opt: torch.optim.Optimizer, state: dict, lr: torch.Tensor | list[torch.Tensor]) -> None:
    """Load an optimizer state saved on any backend. load_state_dict takes each group's flags
    from the file (an XLA checkpoint says capturable, which the CPU refuses), so this backend's
    flags are put back, a capturable optimizer gets its step counts on the parameters' device,
    and every group keeps its device lr tensor (load_state_dict replaced it): `lr`, shared, or
    one per group."""
    flags = {k: opt.defaults[k] for k in OPTIMIZER_FLAGS if k in opt.defaults}
    lrs = lr if isinstance(lr, list) else [lr] * len(opt.param_groups)
    opt.load_state_dict(state)
    for g, g_lr in zip(opt.param_groups, lrs):
        g.update(flags, lr=g_lr)
        if flags.get("capturable") or flags.get("fused"):
            for p in g["params"]:
                st = opt.state.get(p, {})
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(device=p.device, dtype=torch.float32)


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's state (step count, moments) before the first update, as its first step
    would: zeros, the step count on the parameter's device for a fused or capturable optimizer.
    The first step then runs the graph every later step runs (XLA compiles the step once per
    launch, not twice) and checkpoints hold the same keys from step 0."""
    for g in opt.param_groups:
        on_device = g.get("fused") or g.get("capturable")
        for p in g["params"]:
            st = opt.state[p]
            if st:
                continue
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


GUARD_PATHS = ("found_inf", "branch", "select")


def guard_path(opt: torch.optim.Optimizer, ok: torch.Tensor) -> str:
    """How guarded_step skips: a fused optimizer (CPU, CUDA) through `found_inf`; otherwise a
    host branch on the CPU and copy-and-select elsewhere (XLA)."""
    if opt.defaults.get("fused"):
        return "found_inf"
    return "branch" if ok.device.type == "cpu" else "select"


@torch.no_grad()
def guarded_step(opt: torch.optim.Optimizer, ok: torch.Tensor, path: str | None = None) -> None:
    """opt.step() only where `ok` (a 0-dim bool device tensor), leaving the parameters and the
    optimizer state (AdamW moments and step count) exactly as they were on a skip.

    `path` (default guard_path): "found_inf" hands the fused AdamW kernel `found_inf = not ok`:
    it leaves parameters and moments untouched and takes the step count back, on the device,
    with no host sync and no copies (the CPU runs the code CUDA runs). "branch" reads `ok` on
    the host (free on a CPU, which computes anyway). "select" copies the parameters and state
    first and selects them back with torch.where: one graph whatever the decision, so XLA
    compiles once (it cost 42% of a batch-2 ViT-B CPU step, docs/measurements.md). A state the
    step created (first update) falls back to zeros, AdamW's initial state. A group whose lr is
    0 keeps its weights as they were (capturable AdamW divides by the lr: 0/0 where a moment is 0)."""
    path = path or guard_path(opt, ok)
    if path == "found_inf":
        opt.found_inf = (~ok).float()
        try:
            opt.step()
        finally:
            del opt.found_inf
        return
    if path == "branch":
        if bool(ok):
            opt.step()
        return
    before = []
    for g in opt.param_groups:
        moved = ok & (torch.as_tensor(g["lr"], device=ok.device) != 0)
        for p in g["params"]:
            if p.grad is not None:
                state = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                before.append((p, moved, p.detach().clone(), state))
    opt.step()
    for p, moved, old, old_state in before:
        torch.where(moved, p, old, out=p)
        for k, v in opt.state[p].items():
            if torch.is_tensor(v):
                prev = old_state[k] if k in old_state else torch.zeros_like(v)
                torch.where(ok.to(v.device), v, prev, out=v)

"""One device layer for cpu, cuda and xla; the training code calls only this.

cpu/cuda: torchrun starts one process per device; DDP (gloo or nccl) averages gradients.
xla: one process per host with SPMD; the batch is sharded over the "data" axis of a
(data, model) mesh, so data parallelism needs no change to model code (the "model" axis is
left for FSDP-style sharding later).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from octfm.config import ConfigError


@dataclasses.dataclass
class Runtime:
    kind: str                  # cpu | cuda | xla
    device: torch.device
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    bf16: bool = False
    mesh: object | None = None  # xla SPMD mesh

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1 and self.kind != "xla"

    def autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type="xla" if self.kind == "xla" else self.device.type, dtype=torch.bfloat16)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            return DDP(model, device_ids=[self.local_rank] if self.kind == "cuda" else None)
        return model

    def no_sync(self, model, active: bool):
        """Skip DDP's gradient all-reduce on accumulation micro-steps."""
        if active and self.distributed:
            return model.no_sync()
        return contextlib.nullcontext()

    def sync(self) -> None:
        """End of an XLA step (compile + run the graph); a no-op elsewhere."""
        if self.kind == "xla":
            import torch_xla

            torch_xla.sync()

    def all_mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            t = t.clone()
            dist.all_reduce(t)
            t /= self.world
        return t

    def to_device(self, batch: dict) -> dict:
        if self.kind == "xla":
            return batch  # MpDeviceLoader already placed (and sharded) it
        nb = self.kind == "cuda"
        return {k: v.to(self.device, non_blocking=nb) for k, v in batch.items()}

    def loader(self, dl):
        """On XLA, MpDeviceLoader: host-to-device copies overlap compute, and under SPMD
        every batch tensor is sharded along its batch axis over the mesh's data axis (the
        tensors read off one item of the dataset, so a key the config adds is never missed)."""
        if self.kind != "xla":
            return dl
        import torch_xla.distributed.parallel_loader as pl

        sharding = _batch_sharding(self.mesh, batch_ranks(dl.dataset[(0, 0)])) if self.mesh is not None else None
        return pl.MpDeviceLoader(dl, self.device, input_sharding=sharding)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def shutdown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def batch_ranks(item: dict) -> dict[str, int]:
    """Each batch tensor's rank, from one dataset item (the loader stacks items on a new first axis)."""
    return {k: v.dim() + 1 for k, v in item.items()}


def _batch_sharding(mesh, ranks: dict[str, int]) -> dict:
    """Shard every batch tensor along its first (batch) axis over the data axis. With several
    hosts each loads its own slice of the global batch (minibatch=True)."""
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    multi_host = xr.process_count() > 1
    return {k: xs.ShardingSpec(mesh, ("data",) + (None,) * (n - 1), minibatch=multi_host) for k, n in ranks.items()}


def setup(kind: str = "auto", precision: str = "bf16") -> Runtime:
    """Choose the device and start the process group (torchrun's environment) if any."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else ("xla" if _xla_available() else "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda was asked for but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        bf16 = precision == "bf16" and torch.cuda.is_bf16_supported()
        if world > 1:
            dist.init_process_group("nccl")
        return Runtime("cuda", device, rank, world, local_rank, bf16)
    if kind == "xla":
        if not _xla_available():
            raise ConfigError("device: xla was asked for but torch_xla is not installed (see `make test-xla`)")
        import numpy as np
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        cache = os.environ.get("OCTFM_XLA_CACHE", os.path.expanduser("~/.cache/octfm/xla"))
        xr.initialize_cache(cache, readonly=False)
        n = xr.global_runtime_device_count()
        mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
        return Runtime("xla", torch_xla.device(), xr.process_index(), xr.process_count(), 0,
                       precision == "bf16", mesh)
    if kind != "cpu":
        raise ConfigError(f"device: {kind!r} is not one of auto, cpu, cuda, xla")
    if world > 1:
        dist.init_process_group("gloo")
    return Runtime("cpu", torch.device("cpu"), rank, world, local_rank, precision == "bf16")


def _xla_available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("PJRT_DEVICE"))

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
import sys

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
    devices: int | None = None  # xla: the chips of every host; elsewhere one per process (None)

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1 and self.kind != "xla"

    @property
    def hosts(self) -> int:
        """Machines in the run: XLA SPMD runs one process per host; torchrun starts
        LOCAL_WORLD_SIZE processes on each of WORLD_SIZE / LOCAL_WORLD_SIZE nodes."""
        if self.kind == "xla":
            return self.world
        return max(1, self.world // self.local_world)

    @property
    def local_world(self) -> int:
        """Processes on this host, which share its page cache: torchrun's LOCAL_WORLD_SIZE; one under XLA SPMD."""
        if self.kind == "xla":
            return 1
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world))

    @property
    def host(self) -> int:
        """This host's number, 0 to hosts - 1: torchrun's node rank (GROUP_RANK); the process under XLA SPMD."""
        if self.kind == "xla":
            return self.rank
        return int(os.environ.get("GROUP_RANK", self.rank // self.local_world))

    @property
    def chips(self) -> int:
        """Accelerators the global batch is split over: every host's under XLA SPMD, else one per process."""
        return self.devices or self.world

    @property
    def collective_snapshot(self) -> bool:
        """Whether reading the state to the host is a collective every process must join: under
        XLA SPMD a tensor may be sharded across hosts (FSDP later), so every host copies it out;
        under DDP each process holds whole replicas and rank 0 alone reads them."""
        return self.kind == "xla"

    def autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type="xla" if self.kind == "xla" else self.device.type, dtype=torch.bfloat16)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # the positions are constant buffers: nothing to broadcast every forward
            return DDP(model, device_ids=[self.local_rank] if self.kind == "cuda" else None, broadcast_buffers=False)
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

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every process (a MIN all-reduce under DDP): one choice that every
        rank must take alike, from what each sees of its own device. Every process must call it."""
        if not self.distributed:
            return flag
        t = torch.tensor(int(flag), device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def to_device(self, batch: dict) -> dict:
        if self.kind == "xla":
            return batch  # MpDeviceLoader already placed (and sharded) it
        nb = self.kind == "cuda"
        return {k: v.to(self.device, non_blocking=nb) for k, v in batch.items()}

    def loader(self, dl):
        """On CUDA, the next batch is copied on a side stream while this one computes
        (Prefetcher). On XLA, MpDeviceLoader: host-to-device copies overlap compute, and under
        SPMD every batch tensor is sharded along its batch axis over the mesh's data axis (the
        tensors read off one item of the dataset, so a key the config adds is never missed)."""
        if self.kind == "cuda":
            return Prefetcher(dl, self.device)
        if self.kind != "xla":
            return dl
        import torch_xla.distributed.parallel_loader as pl

        sharding = _batch_sharding(self.mesh, batch_ranks(dl.dataset[(0, 0)])) if self.mesh is not None else None
        return pl.MpDeviceLoader(dl, self.device, input_sharding=sharding)

    def replicate(self, tensors) -> None:
        """Place state tensors (weights, optimizer state, schedule scalars) on the XLA mesh as
        replicated, as the step's outputs will be: otherwise the first step reads them without a
        sharding and the second with one, and XLA compiles the step twice. A no-op elsewhere."""
        if self.kind != "xla" or self.mesh is None:
            return
        import torch_xla.distributed.spmd as xs

        for t in tensors:
            xs.mark_sharding(t, self.mesh, (None,) * t.dim())

    def barrier(self) -> None:
        """Every process waits for the others. Under XLA SPMD: a sum over a tensor sharded along
        the data axis, read back on the host, which no host finishes before all have run it."""
        if self.distributed:
            dist.barrier()
        elif self.kind == "xla" and self.mesh is not None:
            import torch_xla
            import torch_xla.distributed.spmd as xs

            t = torch.ones(self.mesh.size(), device=self.device)
            xs.mark_sharding(t, self.mesh, ("data",))
            total = t.sum()
            torch_xla.sync()
            total.cpu()

    def shutdown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


class Prefetcher:
    """Iterates a loader's batches already on `device`, one batch ahead: the copy of batch k+1
    is issued while batch k computes. On CUDA it runs on a side stream (from pinned memory,
    non-blocking) and records an event after each batch's copy; the compute stream waits on that
    batch's event only (waiting on the side stream would also wait for the next batch's copy,
    issued right after), and each tensor is recorded on the compute stream so its memory is not
    reused while still read. Elsewhere the copy is a plain `.to` (tests run this path)."""

    def __init__(self, dl, device: torch.device | str):
        self.dl, self.device = dl, torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _copy(self, batch: dict) -> tuple[dict, object]:
        if self.stream is None:
            return {k: v.to(self.device) for k, v in batch.items()}, None
        with torch.cuda.stream(self.stream):
            out = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def _hand_out(self, copied: tuple[dict, object]) -> dict:
        batch, done = copied
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            for v in batch.values():
                v.record_stream(compute)
        return batch

    def __iter__(self):
        """The loader's iterator starts here, not at the first batch: its workers start now."""
        return self._batches(iter(self.dl))

    def _batches(self, it):
        try:
            ahead = self._copy(next(it))
        except StopIteration:
            return
        for nxt in it:
            current, ahead = ahead, self._copy(nxt)
            yield self._hand_out(current)
        yield self._hand_out(ahead)


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


def compile_modules(*modules: torch.nn.Module) -> None:
    """torch.compile each module in place (inductor; state_dict keys unchanged, so checkpoints
    load either way). Shapes are fixed per config, so a run compiles once per graph: the
    training step, and each of validation's and the online probe's no-grad passes. The student
    is compiled after the DDP wrap (Trainer.network): compiled around DDP, the backward is split
    at its gradient buckets so the all-reduce overlaps it."""
    for m in modules:
        m.compile()


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
        from train import attention

        attention.use_fused_kernels()  # once per process, before any step is traced or run
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
        xs.set_global_mesh(mesh)  # the flash-attention kernel reads it (train/attention.py)
        return Runtime("xla", torch_xla.device(), xr.process_index(), xr.process_count(), 0,
                       precision == "bf16", mesh, devices=n)
    if kind != "cpu":
        raise ConfigError(f"device: {kind!r} is not one of auto, cpu, cuda, xla")
    if world > 1:
        dist.init_process_group("gloo")
    if precision == "bf16" and rank == 0 and not cpu_has_bf16():
        print(f"warning: precision: bf16 on a CPU without native bf16 ({torch.backends.cpu.get_cpu_capability()}): "
              f"autocast emulates it, about 13x slower than fp32 (docs/measurements.md); set precision=fp32",
              file=sys.stderr)
    return Runtime("cpu", torch.device("cpu"), rank, world, local_rank, precision == "bf16")


def device_for(kind: str) -> str:
    """A torch device for evaluation (probes, the leaderboard, embeddings): `kind` as given, or for
    "auto" the accelerator when there is one (CUDA, else torch_xla with PJRT_DEVICE set), else the CPU."""
    if kind != "auto":
        return kind
    if torch.cuda.is_available():
        return "cuda"
    if _xla_available():
        import torch_xla

        return str(torch_xla.device())
    return "cpu"


def cpu_has_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here (AVX512-BF16 or AMX); on an AVX2 CPU
    bf16 autocast is emulated and far slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True  # cannot tell: no warning


def _xla_available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("PJRT_DEVICE"))

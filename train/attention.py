"""Attention for every backend behind one function, `attend`, which the model's blocks call.

The kernel is chosen by where the tensors live, so model code never names a backend:

- TPU (torch_xla): the Pallas flash-attention kernel of torch_xla. Its memory is linear in the
  sequence; XLA's own lowering of SDPA is the math path, which materialises [B, H, N, N]
  scores (11 GB per predictor layer at the production config: docs/accelerators.md).
- CUDA: SDPA restricted to its flash and memory-efficient kernels, set once per process
  (`use_fused_kernels`), not per call. The math kernel is never allowed: where neither applies
  the call fails and says so, instead of silently running out of memory at ViT-B shapes. With
  OCTFM_SDPA_CUDNN=1 cuDNN's attention comes first: it builds a graph per new shape at its first
  call (public reports: hundreds of ms to seconds each on Hopper); `make device-check` times the
  production and check steps both ways, and the default follows what the card shows.
- CPU, and torch_xla on its CPU backend (the test lane): SDPA as PyTorch chooses (its CPU flash
  kernel).

Every token attends to every token. On the TPU kernel the sequence is padded to the kernel's
block size with a segment of its own (segment ids), because torch_xla pads keys with zeros that
would otherwise take part in the softmax.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

# Kernels by name, and how their memory grows with the sequence length N (the plan's input).
PALLAS_FLASH = "pallas-flash"
SDPA_FUSED = "sdpa-fused"   # CUDA: flash / memory-efficient (cuDNN on request), never math
SDPA = "sdpa"               # CPU: PyTorch's choice
MATH = "math"               # XLA off TPU: the scores in full
MEMORY = {PALLAS_FLASH: "linear", SDPA_FUSED: "linear", SDPA: "linear", MATH: "quadratic"}

# The Pallas kernel's block sizes along the sequence (torch_xla's FlashAttention defaults): a
# sequence longer than one q block must be a whole number of them.
PALLAS_MIN_BLOCK, PALLAS_BLOCK = 128, 512


def kernel_for(device_type: str, platform: str | None = None) -> str:
    """The kernel `attend` uses for tensors on `device_type` (cpu, cuda, xla); for xla,
    `platform` is the PJRT device type (TPU, CPU, ...)."""
    if device_type == "cuda":
        return SDPA_FUSED
    if device_type == "xla":
        return PALLAS_FLASH if platform == "TPU" else MATH
    return SDPA


@functools.lru_cache(maxsize=None)
def xla_platform() -> str:
    """The PJRT device type of this process (TPU, CPU, CUDA), read once."""
    import torch_xla.runtime as xr

    return xr.device_type()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q, k, v [B, H, N, Dh] (scale 1/sqrt(Dh)) over all keys."""
    kind = q.device.type
    kernel = kernel_for(kind, xla_platform() if kind == "xla" else None)
    return KERNELS[kernel](q, k, v)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


CUDNN_ENV = "OCTFM_SDPA_CUDNN"  # "1": cuDNN attention first, then flash and memory-efficient


@functools.lru_cache(maxsize=None)
def cuda_backends() -> tuple:
    """The SDPA kernels a CUDA call may use, in priority order: flash and memory-efficient;
    cuDNN's first when OCTFM_SDPA_CUDNN=1 (read once per process)."""
    from torch.nn.attention import SDPBackend

    chosen = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if os.environ.get(CUDNN_ENV) == "1":
        chosen.insert(0, SDPBackend.CUDNN_ATTENTION)
    return tuple(chosen)


_FUSED_ONLY = False  # whether use_fused_kernels has set this process's SDPA backends


def use_fused_kernels() -> None:
    """Restrict SDPA to `cuda_backends()`, in that order, for the whole process: set once,
    outside traced code (runtime.setup on CUDA, or the first fused call). A context entered
    around every call cost host time on each of a step's ~100 attention calls and was traced
    into every compiled graph. SDPA's dispatcher then picks, per shape, the first allowed kernel
    that takes it; the math kernel is never allowed, so a shape none takes fails loudly instead
    of running out of memory at ViT-B sizes."""
    global _FUSED_ONLY
    from torch.nn.attention import SDPBackend

    chosen = cuda_backends()
    torch.backends.cuda.enable_math_sdp(False)
    torch.backends.cuda.enable_flash_sdp(SDPBackend.FLASH_ATTENTION in chosen)
    torch.backends.cuda.enable_mem_efficient_sdp(SDPBackend.EFFICIENT_ATTENTION in chosen)
    torch.backends.cuda.enable_cudnn_sdp(SDPBackend.CUDNN_ATTENTION in chosen)
    if hasattr(torch._C, "_set_sdp_priority_order"):  # the order sdpa_kernel(..., set_priority=True) sets
        order = [int(b) for b in chosen]
        torch._C._set_sdp_priority_order(order + [b for b in torch._C._get_sdp_priority_order() if b not in order])
    _FUSED_ONLY = True


def sdpa_fused(q, k, v):
    if not _FUSED_ONLY:  # set once; a compiled graph sees the branch resolved
        use_fused_kernels()
    return F.scaled_dot_product_attention(q, k, v)


def pallas_length(n: int) -> int:
    """The sequence length the Pallas kernel is given for n tokens: one block of a multiple of
    128 up to 512 tokens, else a multiple of 512."""
    block = PALLAS_MIN_BLOCK if n <= PALLAS_BLOCK else PALLAS_BLOCK
    return -(-n // block) * block


def flash_call():
    """torch_xla's Pallas flash attention (a function, so tests can stand a reference in)."""
    from torch_xla.experimental.custom_kernel import flash_attention

    return flash_attention


def spmd_layout():
    """(partition_spec, mesh) for the kernel under SPMD: the batch sharded over the mesh's data
    axis (runtime.setup sets the global mesh); (None, None) without a mesh."""
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh()
    return (None, None) if mesh is None else (("data", None, None, None), mesh)


def pallas_flash(q, k, v):
    """The TPU kernel. The padding to whole blocks becomes segment ids (1 real, 0 padding): a real
    query sees only real keys; a padding query sees padding (its output is dropped)."""
    b, _, n, dh = q.shape
    n_pad = pallas_length(n)
    seg = None
    if n_pad != n:
        seg = F.pad(torch.ones(b, n, dtype=torch.int32, device=q.device), (0, n_pad - n))
        q, k, v = (F.pad(t, (0, 0, 0, n_pad - n)) for t in (q, k, v))
    spec, mesh = spmd_layout()
    o = flash_call()(q, k, v, causal=False, q_segment_ids=seg, kv_segment_ids=seg, sm_scale=1.0 / math.sqrt(dh),
                     partition_spec=spec, mesh=mesh)
    return o[:, :, :n]


def math_attention(q, k, v):
    """SDPA's math path (XLA's lowering off TPU): scores [B, H, N, N] in full."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.device.type == "xla":  # torch_xla lowers SDPA itself; the context manager is for eager CPU/CUDA
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v)


KERNELS = {PALLAS_FLASH: pallas_flash, SDPA_FUSED: sdpa_fused, SDPA: sdpa, MATH: math_attention}

"""train/attention.py: which kernel each backend gets, and that the TPU kernel's wrapper (padding
to the Pallas block sizes, segment ids for the padding, the scale, the SPMD layout) computes
plain softmax attention. The Pallas kernel itself needs a TPU: a stand-in with its documented
semantics (torch_xla's FlashAttention: q blocks of min(512, N) that must divide N; keys padded
with zeros; segment ids; sm_scale defaulting to 1) takes its place and records what it is given."""
import math

import pytest
import torch

from train import attention, model
from train.config import ModelConfig


def reference(q, k, v):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return (s.softmax(-1) @ v.double()).to(q.dtype)


class FakePallas:
    """torch_xla's flash_attention, on the CPU: what the Pallas kernel computes and refuses."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, *,
                 ab=None, partition_spec=None, mesh=None):
        n = q.shape[2]
        block_q = min(attention.PALLAS_BLOCK, n)
        assert n % block_q == 0 and block_q % 8 == 0, f"the Pallas kernel needs whole q blocks: N={n}"
        assert (q_segment_ids is None) == (kv_segment_ids is None)
        if q_segment_ids is not None:
            assert q_segment_ids.dtype == torch.int32 and q_segment_ids.shape == q.shape[:1] + q.shape[2:3]
        self.calls.append({"shape": tuple(q.shape), "segments": q_segment_ids is not None, "scale": sm_scale,
                           "spec": partition_spec, "mesh": mesh})
        s = (q.double() @ k.double().transpose(-1, -2)) * sm_scale
        if q_segment_ids is not None:
            same = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
            s = s.masked_fill(~same, float("-inf"))
        return (s.softmax(-1) @ v.double()).to(q.dtype)


@pytest.fixture
def pallas(monkeypatch):
    fake = FakePallas()
    monkeypatch.setattr(attention, "flash_call", lambda: fake)
    monkeypatch.setattr(attention, "spmd_layout", lambda: (("data", None, None, None), "mesh"))
    return fake


def test_each_backend_gets_a_kernel_whose_memory_is_linear_but_xla_off_tpu():
    assert attention.kernel_for("xla", "TPU") == attention.PALLAS_FLASH
    assert attention.kernel_for("cuda") == attention.SDPA_FUSED
    assert attention.kernel_for("cpu") == attention.SDPA
    assert attention.kernel_for("xla", "CPU") == attention.MATH  # the test lane only
    for kernel in (attention.PALLAS_FLASH, attention.SDPA_FUSED):
        assert attention.MEMORY[kernel] == "linear"


@pytest.mark.parametrize("n", [72, 128, 300, 512, 513, 2760])
def test_the_tpu_wrapper_pads_to_whole_blocks_and_matches_softmax_attention(pallas, n):
    torch.manual_seed(n)
    b, h, dh = (2, 3, 16) if n <= 1024 else (1, 1, 16)  # the longest sequence alone: its double-precision scores
    q, k, v = (torch.randn(b, h, n, dh) for _ in range(3))
    out = attention.pallas_flash(q, k, v)
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference(q, k, v), rtol=1e-5, atol=1e-5)
    (call,) = pallas.calls
    n_pad = call["shape"][2]
    assert n_pad == attention.pallas_length(n) and n_pad >= n
    assert n_pad % (128 if n <= 512 else 512) == 0
    assert call["segments"] == (n_pad != n)  # no segment ids when nothing is padded
    assert call["scale"] == pytest.approx(dh ** -0.5)
    assert call["spec"] == ("data", None, None, None) and call["mesh"] == "mesh"


def test_the_model_routes_through_attend(monkeypatch):
    """Every block's attention goes through `attend` (so a backend's kernel reaches the whole model)."""
    seen = []
    real = attention.attend

    def spy(q, k, v):
        seen.append(tuple(q.shape))
        return real(q, k, v)

    monkeypatch.setattr(attention, "attend", spy)
    cfg = ModelConfig(dim=32, depth=2, heads=2, pred_dim=16, pred_depth=1, pred_heads=2)
    enc = model.Encoder(cfg, (8, 32, 32))
    enc(torch.rand(2, 1, 8, 32, 32))
    assert len(seen) == 2 and seen[0] == (2, 2, enc.num_tokens, 16)


@pytest.fixture
def sdpa_flags():
    """The process's SDPA backend flags and priority, put back after the test."""
    from torch.nn.attention import _cur_sdpa_kernel_backends, _sdpa_kernel

    saved, order = _cur_sdpa_kernel_backends(), torch._C._get_sdp_priority_order()
    attention.cuda_backends.cache_clear()
    yield
    _sdpa_kernel(saved)
    torch._C._set_sdp_priority_order(order)
    attention.cuda_backends.cache_clear()
    attention._FUSED_ONLY = False


def test_cuda_kernels_never_include_the_math_path(sdpa_flags, monkeypatch):
    """On CUDA SDPA may choose among flash and memory-efficient only (cuDNN first with
    OCTFM_SDPA_CUDNN=1), set once for the process by the first fused call, not per call (the CPU
    runs the same call: its flash kernel)."""
    monkeypatch.delenv(attention.CUDNN_ENV, raising=False)
    attention._FUSED_ONLY = False
    q = torch.randn(2, 2, 40, 8)
    torch.testing.assert_close(attention.sdpa_fused(q, q, q), reference(q, q, q), rtol=1e-4, atol=1e-4)
    assert attention._FUSED_ONLY
    assert not torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


def test_row_gather_matches_an_elementwise_gather_in_value_and_gradient():
    torch.manual_seed(0)
    x = torch.randn(3, 50, 8, requires_grad=True)
    idx = torch.stack([torch.randperm(50)[:20] for _ in range(3)]).to(torch.int32)
    got = model.gather_tokens(x, idx)
    want = torch.gather(x, 1, idx.long().unsqueeze(-1).expand(-1, -1, 8))
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    (ga,) = torch.autograd.grad(got, x, g)
    (gb,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(ga, gb)
    pos = torch.randn(50, 8)
    torch.testing.assert_close(model.gather_rows(pos, idx), pos[idx.long()])


def test_cuda_calls_leave_out_cudnn_attention_unless_asked(sdpa_flags, monkeypatch):
    """Flash and memory-efficient only by default (cuDNN builds a graph per new shape at its first
    call); OCTFM_SDPA_CUDNN=1 puts cuDNN first in SDPA's priority, for device-check's comparison."""
    from torch.nn.attention import SDPBackend

    monkeypatch.delenv(attention.CUDNN_ENV, raising=False)
    assert attention.cuda_backends() == (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    attention.cuda_backends.cache_clear()
    monkeypatch.setenv(attention.CUDNN_ENV, "1")
    attention.use_fused_kernels()
    assert attention.cuda_backends()[0] == SDPBackend.CUDNN_ATTENTION and torch.backends.cuda.cudnn_sdp_enabled()
    assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)

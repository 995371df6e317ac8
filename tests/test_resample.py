"""The cache's resampling (weight matrices in slabs) against the float32 F.interpolate path it
replaced: at most 1 level apart on >= 99.9% of voxels, and the check catches a wrong filter."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ingest import preprocess as prep
from ingest import phantom

CASES = [  # (native shape, target): shrink every axis (Triton-like), upsample frames (Spectralis-like), identity
    ((24, 124, 64), (8, 48, 48)),
    ((13, 62, 96), (16, 48, 48)),
    ((8, 48, 48), (8, 48, 48)),
]


def volume(shape, dtype=np.uint8, seed=0):
    vol = phantom.make_volume(shape, np.random.default_rng(seed), "R")
    return vol if dtype == np.uint8 else vol.astype(np.uint16) * 16 + 7


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
@pytest.mark.parametrize("shape,target", CASES)
def test_resample_matches_the_float_reference(shape, target, dtype):
    vol = volume(shape, dtype)
    lo, hi = prep.window(vol, prep.PreprocessConfig())
    new = prep.rescale_resize(vol, lo, hi, target, slab_frames=4)  # several slabs even on small volumes
    within, worst = prep.level_agreement(new, prep.reference_resize(vol, lo, hi, target))
    assert new.dtype == np.uint8 and new.shape == target
    assert within >= 0.999 and worst <= 1, (within, worst)


def test_the_check_fails_for_a_filter_without_antialiasing():
    """The same comparison rejects a plain bilinear resize (no antialias): the test can fail."""
    vol = volume(CASES[0][0])
    lo, hi = prep.window(vol, prep.PreprocessConfig())
    x = torch.from_numpy(vol.astype(np.float32)).sub_(lo).mul_(255 / (hi - lo)).clamp_(0, 255)
    plain = F.interpolate(x[None, None], size=CASES[0][1], mode="trilinear", align_corners=False)[0, 0]
    plain = plain.round_().clamp_(0, 255).to(torch.uint8).numpy()
    within, worst = prep.level_agreement(plain, prep.reference_resize(vol, lo, hi, CASES[0][1]))
    assert within < 0.999 and worst > 1, (within, worst)


def test_weights_are_torch_antialias_weights():
    for n_in, n_out in ((992, 384), (512, 384), (61, 64), (256, 64), (100, 33), (7, 7)):
        x = torch.rand(1, 1, n_in, 3, generator=torch.Generator().manual_seed(n_in))
        ref = F.interpolate(x, size=(n_out, 3), mode="bilinear", antialias=True, align_corners=False)[0, 0]
        torch.testing.assert_close(torch.from_numpy(prep.aa_weights(n_in, n_out)) @ x[0, 0], ref, atol=1e-4, rtol=0)


def test_a_flipped_view_resamples_like_its_upright_copy():
    vol = volume(CASES[0][0])
    lo, hi = prep.window(vol, prep.PreprocessConfig())
    flipped = np.flip(vol, axis=(0, 2))
    np.testing.assert_array_equal(prep.rescale_resize(flipped, lo, hi, CASES[0][1], 4),
                                  prep.rescale_resize(flipped.copy(), lo, hi, CASES[0][1], 4))


def test_frame_blocks_cover_every_output_once_within_the_slab():
    w = prep.aa_weights(256, 64)
    blocks = prep.frame_blocks(w, 16)
    assert [b[0] for b in blocks[1:]] == [b[1] for b in blocks[:-1]] and blocks[0][0] == 0 and blocks[-1][1] == 64
    assert all(k1 - k0 <= 16 for _, _, k0, k1 in blocks)
    assert all((k0, k1) == prep.input_span(w[j0:j1]) for j0, j1, k0, k1 in blocks)

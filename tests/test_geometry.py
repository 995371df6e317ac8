"""A scan's pattern and orientation from its frames' traces, the protocols' names, and the two
ways to resample (grid, spacing)."""
import numpy as np
import pytest

from ingest import geometry, synth
from ingest import preprocess as prep
from manifests import protocols
from manifests.protocols import PROTOCOLS


def traces(protocol: str, frames=16, cols=64, reverse=False):
    spacing = (0.1, 0.004, 0.02)
    return [np.asarray(t).reshape(-1, 2) for t in synth.localizer_traces(PROTOCOLS[protocol], frames, cols, spacing, reverse)]


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_each_protocols_traces_give_its_published_pattern(name):
    assert geometry.scan_pattern(traces(name)) == PROTOCOLS[name].pattern


def test_lines_repeated_at_one_place_or_a_single_frame_are_a_line_and_curves_are_not_a_raster():
    line = [np.array([[100.0, 10.0], [100.0, 600.0]])] * 8
    assert geometry.scan_pattern(line) == "line" and geometry.scan_pattern(line[:1]) == "line"
    circle = np.stack([100 + 50 * np.sin(np.linspace(0, 6.28, 64)), 100 + 50 * np.cos(np.linspace(0, 6.28, 64))], 1)
    assert geometry.scan_pattern([circle] * 3) is None
    radial = traces("spectralis onh rc hr oct")
    assert geometry.scan_pattern(radial + [circle]) == "radial"      # 24 lines and a circle, as ONH-RC may be
    assert geometry.scan_pattern(None) is None and geometry.raster_flips(None) == []


def test_flips_follow_the_traces_order_and_direction():
    up = traces("cirrus mac oct")
    assert geometry.raster_flips(up) == []
    assert geometry.raster_flips(traces("cirrus mac oct", reverse=True)) == [0]
    right_to_left = [t[::-1] for t in up]
    assert geometry.raster_flips(right_to_left) == [2]
    assert geometry.raster_flips(traces("spectralis onh rc hr oct")) == []   # not a raster: left as it is


@pytest.mark.parametrize("name, want", [
    ("1310_spectralis_ppol_mac_hr_oct_oct_l_1.3.6.1.4.1.33437.11.4.9341142.12984163237260.29264.4.1.dcm",
     "spectralis ppol mac hr oct"),                       # a released file name (doubled "oct")
    ("1001_maestro2_3d_macula_oct_l_2.16.840.1.1.dcm", "maestro2 3d macula oct"),
    ("1001_maestro2_macula_6x6_oct_r_2.16.840.1.dcm", "maestro2 macula 6x6 octa"),   # an earlier converter's id
    ("1001_triton_3d_radial_oct_oct_r_1.2.dcm", "triton 3d radial oct"),
    ("1001_cirrus_mac_oct_oct_l_1.2.dcm", "cirrus mac oct"),                 # AI-READI's Cirrus ids
    ("1001_cirrus_disc_oct_oct_r_1.2.dcm", "cirrus disc oct"),
    ("1001_cirrus_macula_6x6_octa_oct_r_1.2.dcm", "cirrus macula 6x6 octa"),
    ("1001_spectralis_mac_20x20_hs_octa_oct_l_1.2.dcm", "spectralis mac 20x20 hs octa"),
    ("1001_maestro2_macula_6x6_octa_oct_l_1.2.dcm", "maestro2 macula 6x6 octa"),
    ("1001_cirrus_mac_cube_512x128_oct_oct_l_1.2.dcm", "cirrus mac oct"),     # this project's earlier spelling
    ("1001_spectralis_mac_20x20_hs_octa_flow_cube_l_1.2.dcm", None),          # the same scan's flow cube: not OCT
    ("1001_triton_bad_truncated.dcm", None), ("notes.dcm", None)])
def test_protocols_are_read_from_release_file_names(name, want):
    assert protocols.from_file_name(name) == want


def test_header_spellings_resolve_to_the_table():
    assert protocols.lookup("Maestro2 Macula 6x6 OCTA") == "maestro2 macula 6x6 octa"
    assert protocols.lookup("triton 3d(h)+radial 12x9 oct") == "triton 3d radial oct"
    assert protocols.lookup("MAC-Macular Cube 512x128") == "cirrus mac oct"       # Zeiss's names stay in Cirrus headers
    assert protocols.canonical("Some   Other_Protocol") == "some other protocol"   # unknown: kept, normalised
    for p in PROTOCOLS.values():
        assert protocols.lookup(p.file_id) == protocols.lookup(p.header_name) == p.name
        assert protocols.from_file_name(p.file_name("1001", "L", "1.2.3")) == p.name


def test_spacing_mode_keeps_the_voxel_size_and_records_the_crop_and_pad():
    """A 12 mm and a 6 mm field at one voxel size: the wide one is cut to the shape's extent, the
    narrow one padded; the same anatomy is as many voxels wide in both."""
    cfg = prep.PreprocessConfig(target_shape=(8, 32, 64), resample="spacing", spacing_mm=(0.75, 0.0625, 0.125))
    rng = np.random.default_rng(0)
    wide = rng.integers(10, 250, size=(16, 64, 128), dtype=np.uint8)     # 12 x 4 x 12 mm at (0.75, 0.0625, 0.09375)
    res = prep.preprocess(wide, cfg, spacing=(0.75, 0.0625, 12 / 128))
    assert res.volume.shape == (8, 32, 64) and res.spacing_mm == [0.75, 0.0625, 0.125]
    assert res.crop_pad == [-8, -32, -32]                                # 16 frames, 64 rows and 96 columns at that size
    narrow = wide[:, :, 32:96]                                           # the middle 6 mm
    res = prep.preprocess(narrow, cfg, spacing=(0.75, 0.0625, 12 / 128))
    assert res.crop_pad == [-8, -32, 16]                                 # 48 columns, padded by 8 on each side
    assert (res.volume[:, :, :8] == 0).all() and (res.volume[:, :, -8:] == 0).all()
    assert res.volume[:, :, 8:-8].mean() > 50
    with pytest.raises(Exception, match="no voxel size.*preprocess.resample"):
        prep.preprocess(wide, cfg, spacing=(float("nan"), 0.0625, 0.09))


def test_grid_mode_is_the_plain_stretch():
    vol = np.random.default_rng(1).integers(0, 255, size=(12, 40, 50), dtype=np.uint8)
    res = prep.preprocess(vol, prep.PreprocessConfig(target_shape=(6, 20, 25)), spacing=(0.1, 0.01, 0.02))
    lo, hi = prep.window(vol, prep.PreprocessConfig())
    np.testing.assert_array_equal(res.volume, prep.rescale_resize(vol, lo, hi, (6, 20, 25)))
    assert res.spacing_mm == pytest.approx([0.2, 0.02, 0.04]) and res.crop_pad is None


def test_broken_or_degenerate_traces_never_fail_a_file():
    """A Reference Coordinates of one value is no trace (the file keeps its order and its protocol's
    pattern, never an internal error), and a zero-length first line does not make a raster a line."""
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    loc = Dataset()
    loc.ReferenceCoordinates = 5.0
    group = Dataset()
    group.OphthalmicFrameLocationSequence = Sequence([loc])
    ds = Dataset()
    ds.PerFrameFunctionalGroupsSequence = Sequence([group, group])
    assert geometry.frame_traces(ds) is None
    raster = traces("cirrus mac oct")
    raster[0] = np.array([[10.0, 10.0], [10.0, 10.0]])
    assert geometry.scan_pattern(raster) == "raster" and geometry.raster_flips(raster) == []

"""The release as AI-READI's converters write it (docs/data.md, "Scan protocols"): every protocol by its
converter's name, a scan's geometry from three witnesses (header, published field, frames' traces), its
protocol from its shape where nothing else names it, orientation by one rule, only OCT taken for OCT,
headers read again when the reading code changes, and files written by a peer's OPT writer."""
import json
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import keys_after_edits

from cache import build as cache_build
from cache import store
from cache.config import CacheConfig
from cache.worker import process_row
from ingest import dicom, phantom, synth
from ingest import scan as scans
from manifests import build, protocols
from manifests.protocols import PROTOCOLS
from octfm import config

SMALL = ["preprocess.target_shape=[8,32,32]", "preprocess.resample=grid"]


def write_scan(path: Path, protocol: str, shape, spacing, *, header_name: str | None = None, traces: bool = True,
               reverse: bool = False, pixels: np.ndarray | None = None) -> Path:
    """One structural cube of `protocol` as AI-READI writes it: its header spacing (Cirrus's overwritten
    thickness included), Protocol Name and, with `traces`, each frame's line on the localizer. `reverse`:
    the frames stored bottom to top (the traces, when written, say so)."""
    p = PROTOCOLS[protocol] if protocol in PROTOCOLS else PROTOCOLS["maestro2 3d macula oct"]
    spec = synth.DEVICES[p.device]
    vol = pixels if pixels is not None else phantom.make_volume(tuple(shape), np.random.default_rng(7), "R")
    if reverse:
        vol = np.ascontiguousarray(vol[::-1])
    lines = synth.localizer_traces(p, shape[0], shape[2], spacing, reverse) if traces else None
    ds = synth.make_dataset(vol, spec, synth.header_spacing(spec, spacing), participant="1001", laterality="R",
                            sop_uid="1.2.3.4", study_uid="1.2", series_uid="1.2.5",
                            protocol_name=p.header_name if header_name is None else header_name, traces=lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(synth.dicom_bytes(ds))
    return path


def process(path: Path, cache: Path, overrides=(), config_path=None, **row) -> dict:
    """One file through the cache worker, as `make cache` runs it."""
    rel = f"retinal_oct/structural_oct/{row.pop('device', 'zeiss_cirrus')}/1001/{path.name}"
    base = {"relpath": rel, "source": str(path), "cache_key": "k", "device": rel.split("/")[2],
            "protocol": protocols.from_file_name(path.name), **row}
    cfg = config.load(CacheConfig, config_path, list(overrides))
    return process_row(base, config.to_dict(cfg), str(cache), "t")


def header_of(path: Path) -> dicom.Header:
    return dicom.read_header(path.read_bytes())


# ---------------------------------------------------------------- names

def test_the_table_holds_the_thirteen_protocols_by_their_converters_names():
    assert len(PROTOCOLS) == 13
    assert {"cirrus_mac_oct", "cirrus_disc_oct", "spectralis_mac_20x20_hs_octa", "maestro2_macula_6x6_octa",
            "triton_3d_radial_oct"} <= {p.file_id for p in PROTOCOLS.values()}
    for p in PROTOCOLS.values():                   # each id, header name and converter file name finds its own row
        assert protocols.lookup(p.file_id) == p.name == protocols.from_file_name(p.file_name("1001", "L", "1.2.3"))
        assert all(protocols.lookup(h) == p.name for h in p.header_names), p.name
    sel = config.load(CacheConfig, None, ["select.protocol=[cirrus mac cube 512x128 oct, Cirrus_Mac_OCT]"]).select
    assert sel.protocol == ["cirrus mac oct", "cirrus mac oct"]   # the earlier spelling still selects the real files


# ---------------------------------------------------------------- geometry

def cirrus_macular_cube(tmp_path, **kw) -> Path:
    """A 512x128 macular cube's geometry at a quarter of its size: 6 x 6 mm over 32 frames and 128 columns,
    whose header says the frames lie 6/128 mm apart (the converter's overwrite), so 1.5 mm in all."""
    p = PROTOCOLS["cirrus mac oct"]
    return write_scan(tmp_path / p.file_name("1001", "R", "1.2.3.4"), p.name, (32, 64, 128), (6 / 32, 2 / 64, 6 / 128), **kw)


def test_the_cirrus_macular_cube_fills_the_shipped_target_with_a_warning(tmp_path):
    path = cirrus_macular_cube(tmp_path)
    shipped = config.load(CacheConfig, "configs/cache.yaml").preprocess
    assert shipped.resample == "spacing" and shipped.target_shape[0] * shipped.spacing_mm[0] == 6.0
    narrow = ["preprocess.target_shape=[64,32,32]"]   # the shipped frames; fewer rows and columns, for time
    out = process(path, tmp_path / "c", narrow, config_path="configs/cache.yaml")
    assert out["status"] == "ok", out["error"]
    assert out["crop_pad"][0] == 0 and out["field_mm"][0] == pytest.approx(6.0)       # 64 of 64 frames hold data
    warning = out["geometry_warning"]
    assert warning.startswith("geometry: across frames: published 6 mm, header 1.5 mm (32 x 0.04688)")
    assert "traces 6 mm" in warning and warning.endswith("used published")
    vol = store.read_volume(str(tmp_path / "c"), out["volume"])
    assert vol[0].any() and vol[-1].any()                                             # no padded frames
    # believing the header instead: 16 of 64 frames would hold data, so the file fails rather than be cached as padding
    out = process(path, tmp_path / "c2", [*narrow, "preprocess.geometry=header"], config_path="configs/cache.yaml")
    assert out["status"] == "failed" and out["error"].startswith(
        "geometry: the data would fill 16 of the 64 voxels across frames"), out["error"]


def test_agreeing_witnesses_leave_no_warning_and_a_protocol_without_a_published_field_keeps_its_header():
    spec = synth.DEVICES["topcon_maestro2"]
    p = PROTOCOLS["maestro2 3d wide oct"]
    ds = synth.make_dataset(np.zeros((16, 8, 32), np.uint8), spec, (9 / 16, 0.1, 12 / 32), participant="1",
                            laterality="R", sop_uid="1.2", study_uid="1.3", series_uid="1.4",
                            traces=synth.localizer_traces(p, 16, 32, (9 / 16, 0.1, 12 / 32)))
    scan = scans.describe(dicom.read_header(synth.dicom_bytes(ds)), {"protocol": p.name})
    assert scan.geometry_warning is None and scan.field_mm == [9.0, 0.8, 12.0]
    ds.ProtocolName = "spectralis ppol mac hr oct"                     # nothing published: the header holds
    scan = scans.describe(dicom.read_header(synth.dicom_bytes(ds)), {})
    assert scan.protocol_by == "header" and scan.field_mm == [9.0, 0.8, 12.0]


def test_the_generator_writes_every_raster_protocol_within_its_field():
    """Each raster protocol's synthetic header spans its published field, and one without a field in
    mm a retina-sized one: the Spectralis 20 x 20 degree OCTA cube once spanned 61 mm across its 512
    frames (the 61-frame cube's frame spacing), a scale table's nonsense row."""
    for name, p in PROTOCOLS.items():
        if p.pattern != protocols.RASTER:
            continue
        (f, _, c), spacing = p.shapes[0], synth.native_spacing(synth.DEVICES[p.device], p)
        across, along = f * spacing[0], c * spacing[2]
        published = [v if v else got for v, got in zip(p.field_mm, (across, along))]
        assert [across, along] == pytest.approx(published), name
        assert 2 < across <= 12 and 2 < along <= 12, (name, across, along)
    sq = PROTOCOLS["spectralis mac 20x20 hs octa"]
    spacing = synth.native_spacing(synth.DEVICES[sq.device], sq)
    assert 512 * spacing[0] == pytest.approx(512 * spacing[2])         # 20 x 20: as wide as it is long


# ---------------------------------------------------------------- orientation

def test_spectralis_octa_is_reversed_as_ai_readi_documents_and_traces_that_disagree_are_reported(tmp_path):
    p = PROTOCOLS["spectralis mac 20x20 hs octa"]
    upright = phantom.make_volume((16, 32, 32), np.random.default_rng(5), "R")
    path = write_scan(tmp_path / p.file_name("1001", "R", "1.2.3.4"), p.name, (16, 32, 32), (0.36, 0.004, 0.18),
                      traces=False, reverse=True, pixels=upright)
    out = process(path, tmp_path / "c", SMALL, device="heidelberg_spectralis")
    assert out["status"] == "ok" and out["protocol"] == p.name and out["flipped_axes"] == [0]
    assert out["flipped"] == f"frames reversed (AI-READI's documented reversal of {p.name})"
    twin = write_scan(tmp_path / "twin" / PROTOCOLS["spectralis ppol mac hr oct"].file_name("1001", "R", "1.2.3.5"),
                      "spectralis ppol mac hr oct", (16, 32, 32), (0.36, 0.004, 0.18), traces=False, pixels=upright)
    same = process(twin, tmp_path / "c2", SMALL, device="heidelberg_spectralis")
    np.testing.assert_array_equal(store.read_volume(str(tmp_path / "c"), out["volume"]),
                                  store.read_volume(str(tmp_path / "c2"), same["volume"]))
    # with traces that run top to bottom, the traces decide and the row says the two disagree
    traced = write_scan(tmp_path / "t" / path.name, p.name, (16, 32, 32), (0.36, 0.004, 0.18), pixels=upright)
    scan = scans.describe(header_of(traced), {"protocol": p.name})
    assert scan.flips == [] and scan.geometry_warning.startswith("orientation: AI-READI documents")


def test_orientation_rules_apply_only_to_files_without_traces(tmp_path):
    from ingest.preprocess import FlipRule

    rule = [FlipRule(device="topcon_maestro2", match="", axes=[0])]
    row = {"device": "topcon_maestro2", "protocol": "maestro2 3d macula oct"}
    args = ("maestro2 3d macula oct", (8, 16, 32), (0.75, 0.01, 0.1875))
    upright = header_of(write_scan(tmp_path / "a.dcm", *args))
    reversed_ = header_of(write_scan(tmp_path / "b.dcm", *args, reverse=True))
    untraced = header_of(write_scan(tmp_path / "c.dcm", *args, traces=False))
    assert scans.describe(upright, row, rules=rule).flips == []           # the rule flipped these before
    assert scans.describe(reversed_, row, rules=rule).flips == [0]        # ... and left these reversed
    scan = scans.describe(untraced, row, rules=rule)
    assert scan.flips == [0] and "preprocess.orientation rule" in scan.flipped


# ---------------------------------------------------------------- shape

def native_header(shape, protocol_name=None) -> dicom.Header:
    """A header alone at a published shape (no pixels: the reading needs none), without traces."""
    from pydicom.dataset import Dataset

    ds = Dataset()
    if protocol_name:
        ds.ProtocolName = protocol_name
    return dicom.Header(ds, None, *shape, 8, None)


@pytest.mark.parametrize("shape, region, want, pattern", [
    ((128, 1024, 512), None, "cirrus mac oct", "raster"),
    ((200, 1024, 200), None, "cirrus disc oct", "raster"),
    ((350, 1024, 350), "Optic Disc, 6 x 6", "cirrus disc 6x6 octa", "raster"),
    ((350, 1024, 350), None, "cirrus protocol of its own", "raster"),  # either 6x6 cube: a raster, 6 x 6 mm,
    ((10, 64, 64), None, "cirrus protocol of its own", None),          # matches nothing: no pattern, skipped
])                                                                     # (these two keep the header's own name)
def test_a_scan_nothing_else_names_is_matched_by_its_shape(shape, region, want, pattern):
    scan = scans.describe(native_header(shape, "Cirrus Protocol Of Its Own"),
                          {"device": "zeiss_cirrus", "anatomic_region": region})
    assert scan.protocol == want and scan.pattern == pattern
    assert scan.protocol_by == ("shape" if pattern else None)
    if pattern:
        assert scan.field_mm[0] == 6.0 and scan.field_mm[2] == 6.0
    maestro = {"device": "topcon_maestro2", "anatomic_region": "Wide Field"}
    assert scans.describe(native_header((128, 885, 512)), maestro).protocol == "maestro2 3d wide oct"
    radial = scans.describe(native_header((27, 496, 768)), {"device": "heidelberg_spectralis"})
    assert radial.pattern == "radial"                                 # a radial protocol's shape: skipped


# ---------------------------------------------------------------- only OCT is OCT

def test_other_modalities_in_an_archive_beside_oct_are_ignored_and_counted(tmp_path):
    cfg = dict(participants=4, scale=16, seed=3, bad_files=False, unlabeled=0, others=True, protocols="all")
    synth.generate(tmp_path / "plain", synth.SynthConfig(**cfg))
    rows, _ = build.build_sources(str(tmp_path / "plain"))
    # the whole release in one ZIP, as a group may keep it: OCT, flow cubes and photographs side by side
    root = tmp_path / "plain"
    with zipfile.ZipFile(root / "release.zip", "w") as zf:
        for folder in ("retinal_oct/structural_oct", "retinal_octa", "retinal_photography"):
            for f in sorted((root / folder).rglob("*.dcm")):
                zf.write(f, f.relative_to(root).as_posix())
                f.unlink()
    zipped, summary = build.build_sources(str(root))
    assert sorted(r["relpath"] for r in zipped) == sorted(r["relpath"] for r in rows)
    assert all(r["relpath"].startswith("retinal_oct/structural_oct/") for r in zipped)
    octa = sum(r["protocol"].endswith("octa") for r in rows)   # an OCTA scan's flow cube, every scan's photo
    assert octa and summary["ignored_by"] == {"flow_cube": octa, "ir": len(rows)}
    # a repacked bucket: one ZIP per scanner, its flow cubes and photographs among the OCT members
    synth.generate(tmp_path / "repack", synth.SynthConfig(**cfg, layout="repack"))
    repacked, summary = build.build_sources(str(tmp_path / "repack"))
    assert len(repacked) == len(rows) and not any("flow_cube" in r["relpath"] for r in repacked)
    assert summary["ignored_by"] == {"flow_cube": octa, "ir": len(rows)}


# ---------------------------------------------------------------- re-reads follow the code

def test_the_reading_key_follows_the_code_that_reads_headers(tmp_path, monkeypatch):
    def keys():
        scans.reading_key.cache_clear()
        return scans.reading_key()

    base, *edits = keys_after_edits(tmp_path, monkeypatch, ["ingest", "manifests", "octfm", "train"], keys,
                                    ["manifests/protocols.py", "ingest/geometry.py", "ingest/dicom.py",
                                     "train/model.py"])
    scans.reading_key.cache_clear()
    assert len({base, *edits[:3]}) == 4 and edits[3] == edits[2]   # the model is not read by a header's reading


def test_a_row_skipped_as_unknown_is_read_again_once_the_table_knows_it(tmp_path, monkeypatch):
    root = tmp_path / "tree"
    synth.generate(root, synth.SynthConfig(participants=4, scale=16, seed=3, bad_files=False, unlabeled=0))
    folder = next((root / "retinal_oct/structural_oct/topcon_maestro2").iterdir())
    mystery = write_scan(folder / "1001_mystery_cube_oct_r_1.2.3.99.dcm", "maestro2 3d macula oct", (8, 16, 32),
                         (0.75, 0.01, 0.1875), header_name="Mystery Cube", traces=False)
    tsv = root / "retinal_oct/manifest.tsv"
    df = pd.read_csv(tsv, sep="\t", dtype=str, keep_default_na=False)
    extra = {**df.iloc[0].to_dict(), "filepath": "/" + mystery.relative_to(root).as_posix(), "sop_instance_uid": "1.2.3.99"}
    pd.concat([df, pd.DataFrame([extra])]).to_csv(tsv, sep="\t", index=False)
    cache = str(tmp_path / "cache")
    cfg = config.load(CacheConfig, None, SMALL)
    # the rows run here, not in a process pool, so the table edit below reaches them (the pool: tests/test_cache.py)
    monkeypatch.setattr(cache_build, "run_pool", lambda todo, cfg, root, tag, on_row: [
        on_row({**r, **process_row(r, config.to_dict(cfg), root, tag)}) for r in todo])
    first = {r["relpath"]: r for r in cache_build.build(str(root), cache, cfg, progress=False)}
    rel = mystery.relative_to(root).as_posix()
    assert first[rel]["status"] == "skipped" and "scan_pattern unknown" in first[rel]["skip_reason"]
    ok_rel = next(k for k, r in first.items() if r["status"] == "ok")
    rows = cache_build.paths.read_sources(cache)[0]
    done, todo = cache_build.plan(rows, cfg, cache, (0, 1))
    assert not todo                                                     # unchanged code: nothing is read again
    # the table learns the name (an edit to manifests/protocols.py, which changes the reading key)
    monkeypatch.setitem(protocols._BY_SPELLING, "mystery cube", "maestro2 3d macula oct")
    monkeypatch.setattr(scans, "reading_key", lambda: "after-an-edit")
    done, todo = cache_build.plan(rows, cfg, cache, (0, 1))
    by_rel = {r["relpath"]: r for r in todo}
    assert rel in by_rel and ok_rel in by_rel                          # every header is read again
    again = process_row(by_rel[rel], config.to_dict(cfg), cache, "t")
    assert again["status"] == "ok" and again["protocol"] == "maestro2 3d macula oct" and again["protocol_by"] == "header"
    volume = Path(cache) / first[ok_rel]["volume"]
    mtime = volume.stat().st_mtime_ns
    kept = process_row(by_rel[ok_rel], config.to_dict(cfg), cache, "t")   # read the same: its volume stands
    assert kept["status"] == "ok" and kept["scan_key"] == first[ok_rel]["scan_key"]
    assert kept["decode_s"] == first[ok_rel]["decode_s"] and volume.stat().st_mtime_ns == mtime


# ---------------------------------------------------------------- smaller defects

def test_a_corrupt_archive_in_a_repacked_bucket_is_named_on_its_rows(tmp_path):
    root = tmp_path / "repack"
    synth.generate(root, synth.SynthConfig(participants=4, scale=16, seed=3, bad_files=False, unlabeled=0,
                                           layout="repack"))
    archive = root / "topcon_triton" / "topcon_triton.zip"
    archive.write_bytes(archive.read_bytes()[:200])
    rows, _ = build.build_sources(str(root))
    triton = [r for r in rows if r["device"] == "topcon_triton"]
    assert triton and all(r["manifest_error"].startswith("corrupt archive: ") and "topcon_triton.zip" in
                          r["manifest_error"] for r in triton), triton[0]["manifest_error"]


def test_a_file_in_two_manifest_parts_is_kept_once(tmp_path, capsys):
    from manifests import paths, schema

    row = {"relpath": "retinal_oct/x/1.dcm", "sop_instance_uid": "1.2.3", "status": "ok", "volume": "volumes/x/1.zarr"}
    other = {"relpath": "retinal_oct/x/2.dcm", "sop_instance_uid": "1.2.4", "status": "ok", "volume": "volumes/x/2.zarr"}
    (tmp_path / "manifest.parquet").mkdir()
    for shard, rows in (((0, 2), [row]), ((1, 2), [row, other])):
        pq.write_table(schema.to_table(rows, schema.CACHE_SCHEMA), paths.part_uri(str(tmp_path), shard))
    df = paths.read_manifest_table(str(tmp_path)).to_pandas()
    assert sorted(df.relpath) == [row["relpath"], other["relpath"]] and (df.status == "ok").all()
    assert "listed in two manifest parts" in capsys.readouterr().err


def test_select_values_that_name_nothing_are_refused_naming_the_key_and_the_nearest():
    with pytest.raises(config.ConfigError, match=r"select.protocol.*'cirus mac oct'.*nearest cirrus mac oct"):
        config.load(CacheConfig, None, ["select.protocol=[cirus mac oct]"])
    with pytest.raises(config.ConfigError, match=r"select.region.*'maculla'.*nearest macula"):
        config.load(CacheConfig, None, ["select.region=[maculla]"])
    sel = config.load(CacheConfig, None, ['select.region=["Macula, 6 x 6", optic_disc]']).select
    assert sel.region == ["macula", "optic disc"]                       # normalised as protocols are


def test_a_grid_volume_without_slice_spacing_writes_strict_json_and_the_error_names_only_that_axis(tmp_path):
    """A Spectralis volume (no published field) with Pixel Spacing per frame, no Slice Thickness, no traces:
    nothing says how far apart its frames lie."""
    p = PROTOCOLS["spectralis ppol mac hr oct"]
    ds = synth.make_dataset(phantom.make_volume((8, 32, 32), np.random.default_rng(2), "R"),
                            synth.DEVICES[p.device], (0.1, 0.01, 0.02), participant="1", laterality="R",
                            sop_uid="1.2.3", study_uid="1.2", series_uid="1.4", per_frame=True)
    path = tmp_path / p.file_name("1001", "R", "1.2.3")
    path.write_bytes(synth.dicom_bytes(ds))
    out = process(path, tmp_path / "c", SMALL, device=p.device)
    assert out["status"] == "ok" and out["spacing_mm"][0] is None and out["spacing_mm"][2] > 0
    for f in (tmp_path / "c").rglob("zarr.json"):
        json.loads(f.read_text(), parse_constant=lambda c: pytest.fail(f"{f}: {c} in JSON"))
    out = process(path, tmp_path / "c2", ["preprocess.resample=spacing", "preprocess.target_shape=[8,32,32]"],
                  device=p.device)
    assert out["error"].startswith("no voxel size across frames:"), out["error"]


# ---------------------------------------------------------------- a peer's files

def peer_file(tmp_path, name: str, spacing, thickness, frames=8, rows=64, cols=32) -> Path:
    """An OPT file written by oct-converter's own writer (16-bit, shared Pixel Measures, no Protocol Name,
    no frame traces), frames growing brighter so the axis order shows."""
    from oct_converter.dicom.dicom import write_opt_dicom
    from oct_converter.dicom.metadata import (DicomMetadata, ImageGeometry, ManufacturerMeta, OCTImageParams,
                                              PatientMeta, SeriesMeta)

    meta = DicomMetadata(PatientMeta(patient_id="1001"), SeriesMeta(series_id="1", laterality="R"),
                         ManufacturerMeta(manufacturer="Topcon"),
                         ImageGeometry(pixel_spacing=list(spacing), slice_thickness=thickness,
                                       image_orientation=[1, 0, 0, 0, 1, 0]), OCTImageParams())
    ramp = np.arange(frames, dtype=np.float32)[:, None, None] + np.zeros((frames, rows, cols), np.float32)
    ramp[:, :, : cols // 2] += np.linspace(0, 1, rows, dtype=np.float32)[None, :, None]
    path = tmp_path / name
    write_opt_dicom(meta, list(ramp), path)
    return path


def test_files_from_oct_converters_writer_are_read_right(tmp_path):
    uid = "1.2.3.4"
    path = peer_file(tmp_path, f"1001_maestro2_3d_macula_oct_oct_r_{uid}.dcm", (0.0026, 0.0117), 0.047)
    out = process(path, tmp_path / "c", ["preprocess.target_shape=[8,64,32]", "preprocess.resample=grid"],
                  device="topcon_maestro2")
    assert out["status"] == "ok", out["error"]
    assert out["native_shape"] == [8, 64, 32] and out["bits_stored"] == 16
    assert out["native_spacing_mm"] == pytest.approx([0.047, 0.0026, 0.0117])
    vol = store.read_volume(str(tmp_path / "c"), out["volume"]).astype(float)
    assert (np.diff(vol.mean(axis=(1, 2))) > 0).all()                              # frames in order
    assert vol[:, :, :16].std(axis=1).mean() > vol[:, :, 16:].std(axis=1).mean()   # rows and columns not swapped
    # under its own name nothing says what it is: skipped, and the reason names the key that would take it
    own = peer_file(tmp_path, "scan.dcm", (0.0026, 0.0117), 0.047)
    out = process(own, tmp_path / "c", SMALL, device="topcon_maestro2", protocol=None)
    assert out["status"] == "skipped" and "select.scan_pattern=[raster,unknown] takes it" in out["skip_reason"]
    # a placeholder spacing under a 6x6 protocol's name: its field is repaired from the published one, and said
    placeholder = peer_file(tmp_path, f"1001_maestro2_3d_macula_oct_oct_r_{uid}.9.dcm", (0.03, 0.01), 0.05,
                            frames=60, rows=96, cols=60)
    out = process(placeholder, tmp_path / "c3", config_path="configs/cache.yaml", device="topcon_maestro2")
    assert out["status"] == "ok" and out["crop_pad"][0] == 0 and out["crop_pad"][2] == 0, out
    assert "across frames: published 6 mm, header 3 mm" in out["geometry_warning"]


@pytest.mark.slow   # three native-size Cirrus cubes (170 MB): the heavy lane; the reading itself is tested above
def test_native_cirrus_cubes_that_nothing_names_are_cached_by_their_shape(tmp_path):
    """A tree like the release's, whose Cirrus files carry neither a known name nor frame traces (Zeiss's own
    Protocol Name, files renamed): each is cached by its shape, and the summary says the shape told it."""
    from conftest import run_cli

    root = tmp_path / "tree"
    synth.generate(root, synth.SynthConfig(participants=4, scale=16, seed=3, bad_files=False, unlabeled=0))
    tsv = root / "retinal_oct/manifest.tsv"
    df = pd.read_csv(tsv, sep="\t", dtype=str, keep_default_na=False)
    extra = []
    for k, (shape, region) in enumerate([((128, 1024, 512), "Macula"), ((200, 1024, 200), "Optic Disc"),
                                         ((350, 1024, 350), "Macula, 6 x 6")]):
        uid = f"1.2.3.{500 + k}"
        path = root / f"retinal_oct/structural_oct/zeiss_cirrus/1001/1001_cube{k}_{uid}.dcm"
        pixels = np.random.default_rng(k).integers(0, 255, shape, dtype=np.uint8)
        write_scan(path, "cirrus mac oct", shape, (6 / shape[0], 2 / 1024, 6 / shape[2]), header_name="Zeiss Cube",
                   traces=False, pixels=pixels)
        extra.append({**df.iloc[0].to_dict(), "filepath": "/" + path.relative_to(root).as_posix(),
                      "sop_instance_uid": uid, "anatomic_region": region, "manufacturer": "Carl Zeiss Meditec"})
    pd.concat([df, pd.DataFrame(extra)]).to_csv(tsv, sep="\t", index=False)
    r = run_cli("cache.build", "--source", str(root), "--cache", str(tmp_path / "cache"), "--no-progress", "--strict",
                *SMALL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = pd.read_parquet(tmp_path / "cache/manifest.parquet").set_index("relpath")
    cubes = got[got.index.str.contains("_cube")]
    assert (cubes.status == "ok").all() and (cubes.protocol_by == "shape").all(), cubes[["status", "skip_reason"]]
    assert sorted(cubes.protocol) == ["cirrus disc oct", "cirrus mac oct", "cirrus macula 6x6 octa"]
    assert "shape 3" in r.stdout


def test_make_manifest_reports_the_cirrus_cubes_geometry_before_any_file_is_read(tmp_path):
    from conftest import run_cli

    synth.generate(tmp_path / "t", synth.SynthConfig(participants=4, scale=16, seed=3, bad_files=False, unlabeled=0))
    rows, summary = build.build_sources(str(tmp_path / "t"))
    cirrus = [r for r in rows if r["protocol"] == "cirrus mac oct"]
    assert cirrus and all(r["geometry_warning"].startswith("geometry: across frames: manifest.tsv 1.5 mm, published 6 mm")
                          for r in cirrus)
    assert not any(r["geometry_warning"] for r in rows if r["device"] != "zeiss_cirrus")
    r = run_cli("manifests.build", "--source", str(tmp_path / "t"), "--out", str(tmp_path / "s.parquet"))
    assert f"published field (make cache reads the headers): cirrus mac oct {len(cirrus)}" in r.stdout, r.stdout

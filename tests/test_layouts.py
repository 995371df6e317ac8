"""The release as users hold it: the layouts its buckets come in (as released, zipped, repacked by a
research group), every scan protocol with its pattern and field, `select`, and a source that changes
under a kept cache."""
import shutil
import zipfile

import numpy as np
import pandas as pd
import pytest
from conftest import run_cli, run_here

from cache import build as cache_build
from cache import store
from cache.config import CacheConfig
from ingest import synth
from manifests import build, protocols
from octfm import config
from octfm.errors import DataError

SHAPE = "preprocess.target_shape=[8,32,32]"


def tree(tmp_path, name="plain", **kw) -> str:
    cfg = dict(participants=8, scale=16, seed=3, bad_files=False, unlabeled=0)
    synth.generate(tmp_path / name, synth.SynthConfig(**{**cfg, **kw}))
    return str(tmp_path / name)


def rows_by_relpath(root: str, **kw) -> pd.DataFrame:
    rows, summary = build.build_sources(root, **kw)
    return pd.DataFrame(rows).set_index("relpath").sort_index(), summary


def test_a_repacked_bucket_finds_every_row_by_name(tmp_path):
    """One group's bucket: the tables at the root, one ZIP per device at <root>/<device>/, members
    <participant>/<file> (one device's written ./<participant>/...), while manifest.tsv keeps the
    release's paths: every row is found by its file name, with the plain tree's rows."""
    plain, repack = tree(tmp_path), tree(tmp_path, "repack", layout="repack")
    a, sa = rows_by_relpath(plain)
    b, sb = rows_by_relpath(repack)
    assert (sa["by_path"], sa["by_name"], sa["not_found"]) == (len(a), 0, 0)
    assert (sb["by_path"], sb["by_name"], sb["not_found"]) == (0, len(b), 0) and sb["layout"].startswith("repacked")
    assert sb["tables"]["oct_manifest"].endswith("repack/manifest.tsv")
    assert list(a.index) == list(b.index) and b.manifest_error.isna().all()
    assert b.source.str.startswith("zip://").all() and b.source.str.contains("zip://./").any()
    same = ["participant_id", "label", "split", "device", "laterality", "protocol", "scan_pattern", "sop_instance_uid"]
    pd.testing.assert_frame_equal(a[same], b[same])


@pytest.mark.slow  # two cache builds (about 10 s): the heavy lane; the rows' match stays in make test
def test_a_repacked_bucket_caches_the_same_volumes_as_the_released_layout(tmp_path):
    plain, repack = tree(tmp_path), tree(tmp_path, "repack", layout="repack")
    out = {}
    for name, root in (("plain", plain), ("repack", repack)):
        r = run_cli("cache.build", "--source", root, "--cache", str(tmp_path / f"c_{name}"), "--no-progress", SHAPE)
        assert r.returncode == 0, r.stderr
        out[name] = pd.read_parquet(tmp_path / f"c_{name}" / "manifest.parquet").set_index("relpath").sort_index()
    assert list(out["plain"].status) == list(out["repack"].status)
    ok = out["plain"][out["plain"].status == "ok"]
    assert len(ok) == (out["plain"].scan_pattern == "raster").sum() > 0
    for vol in ok.volume:
        assert np.array_equal(store.read_volume(str(tmp_path / "c_plain"), vol),
                              store.read_volume(str(tmp_path / "c_repack"), vol))


def test_tables_are_found_at_the_root_in_retinal_oct_or_where_named(tmp_path):
    root = tree(tmp_path, participants=4)
    ref, _ = rows_by_relpath(root)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(f"{root}/participants.tsv", moved / "people.tsv")
    with pytest.raises(DataError, match=r"participants.tsv not found at .*/participants.tsv or .*"
                                         r"retinal_oct/participants.tsv .*PARTICIPANTS=<path>"):
        build.build_sources(root)
    got, summary = rows_by_relpath(root, participants_tsv=str(moved / "people.tsv"))
    assert summary["tables"]["participants"] == str(moved / "people.tsv")
    pd.testing.assert_frame_equal(got.drop(columns="source"), ref.drop(columns="source"))
    shutil.move(moved / "people.tsv", f"{root}/retinal_oct/participants.tsv")   # beside manifest.tsv
    shutil.move(f"{root}/retinal_oct/manifest.tsv", f"{root}/oct.tsv")
    got, summary = rows_by_relpath(root, oct_manifest="oct.tsv")                 # a path under the root
    assert summary["tables"]["oct_manifest"] == f"{root}/oct.tsv" and list(got.index) == list(ref.index)
    r = run_cli("manifests.build", "--source", root, "--out", str(tmp_path / "s.parquet"), "--oct-manifest", "nope.tsv")
    assert r.returncode == 2 and "OCT_MANIFEST=nope.tsv" in r.stderr


def test_release_3_person_id_in_both_tables(tmp_path):
    root = tree(tmp_path, participants=4, id_column="person_id")
    tsv = f"{root}/retinal_oct/manifest.tsv"
    pd.read_csv(tsv, sep="\t", dtype=str).rename(columns={"participant_id": "person_id"}).to_csv(tsv, sep="\t", index=False)
    got, _ = rows_by_relpath(root)
    assert got.participant_id.notna().all() and got.label.notna().all() and got.manifest_error.isna().all()


def test_two_files_with_one_name_are_an_ambiguity_naming_both(tmp_path):
    root = tree(tmp_path, "repack", participants=4, layout="repack")
    first = pd.read_csv(f"{root}/manifest.tsv", sep="\t", dtype=str).filepath[0]
    name = first.rsplit("/", 1)[1]
    (tmp_path / "repack" / "copies").mkdir()
    device = first.split("/")[3]                                   # .../structural_oct/<device>/<pid>/<file>
    other = next(d for d in synth.DEVICES if d != device)          # an archive that does not hold `first`
    shutil.copy(tmp_path / "repack" / other / f"{other}.zip", tmp_path / "repack" / "copies" / "a.zip")
    with zipfile.ZipFile(tmp_path / "repack" / "copies" / "b.zip", "w") as zf:
        zf.writestr(f"x/{name}", b"another file of the same name")
    got, summary = rows_by_relpath(root)
    err = got.loc[first.lstrip("/"), "manifest_error"]
    assert err.startswith("ambiguous: 2 files are named") and err.count(name) == 3, err
    assert "copies/x/" in err and summary["not_found"] >= 1


def test_another_modalitys_dicoms_are_ignored_and_counted(tmp_path):
    root = tree(tmp_path, participants=4)
    photo = tmp_path / "plain" / "retinal_photography" / "cfp" / "icare_eidon" / "1001" / "1001_eidon_l_1.2.dcm"
    photo.parent.mkdir(parents=True)
    photo.write_bytes(b"a fundus photograph")
    got, summary = rows_by_relpath(root)
    assert not got.index.str.startswith("retinal_photography").any()
    assert summary["ignored"] == ["retinal_photography/cfp/icare_eidon/1001/1001_eidon_l_1.2.dcm"]


def test_every_protocol_is_named_patterned_and_cached_or_skipped(tmp_path):
    """A tree with all thirteen protocols: raster volumes cached, every radial scan skipped with its
    reason, nothing failed; protocol, scan_pattern and field_mm on every row, in both manifests."""
    root = tree(tmp_path, participants=4, protocols="all", reversed=("triton macula 12x12 octa",))
    src, _ = rows_by_relpath(root)
    assert set(src.protocol) == set(protocols.PROTOCOLS)
    assert src.scan_pattern.notna().all()
    cache = tmp_path / "cache"
    r = run_here("cache.build", "--source", root, "--cache", str(cache), "--no-progress", "--strict", SHAPE)
    assert r.returncode == 0, r.stdout + r.stderr
    df = pd.read_parquet(cache / "manifest.parquet")
    assert (df.status != "failed").all() and df.protocol.notna().all() and df.scan_pattern.notna().all()
    radial = df[df.protocol == "spectralis onh rc hr oct"]
    assert len(radial) and (radial.status == "skipped").all() and (radial.scan_pattern == "radial").all()
    assert radial.skip_reason.str.contains("select.scan_pattern keeps raster").all()
    ok = df[df.status == "ok"]
    assert len(ok) == len(df) - len(radial) and (ok.scan_pattern == "raster").all()
    assert ok.field_mm.map(lambda f: f is not None and all(v > 0 for v in f)).all()
    wide = ok[ok.protocol == "maestro2 3d wide oct"].field_mm.iloc[0]
    assert wide[0] == pytest.approx(9.0) and wide[2] == pytest.approx(12.0)
    # reversed: the Triton cube by its traces (written bottom to top here), the Spectralis OCTA cube by AI-READI's
    # documented rule (written reversed, without traces, as the generator writes it)
    reversed_ = {"triton macula 12x12 octa": "its frames' traces", "spectralis mac 20x20 hs octa": "AI-READI's documented"}
    for protocol, why in reversed_.items():
        flipped = ok[ok.protocol == protocol]
        assert flipped.flipped_axes.map(list).map(lambda a: a == [0]).all()
        assert flipped.flipped.str.startswith("frames reversed").all() and flipped.flipped.str.contains(why).all()
    assert (ok[~ok.protocol.isin(reversed_)].flipped_axes.map(len) == 0).all() and ok[~ok.protocol.isin(reversed_)].flipped.isna().all()
    for line in ("spectralis onh rc hr oct", "cirrus disc 6x6 octa", "skipped because"):
        assert line in r.stdout


def test_select_by_scanner_protocol_and_region_skips_with_reasons_and_strict_ignores_them(tmp_path):
    root = tree(tmp_path, participants=4, protocols="all")
    r = run_here("cache.build", "--source", root, "--cache", str(tmp_path / "cache"), "--config", "configs/cache.yaml",
                "--no-progress", "--strict", SHAPE, "select.scanner=[topcon_triton,zeiss_cirrus]", "select.region=[macula]")
    assert r.returncode == 0, r.stdout[-2000:]        # skipped rows are not failures
    df = pd.read_parquet(tmp_path / "cache" / "manifest.parquet")
    ok = df[df.status == "ok"]
    assert set(ok.device) == {"topcon_triton", "zeiss_cirrus"}
    assert set(ok.anatomic_region.str.split(",").str[0]) == {"Macula"}
    assert df[df.device == "topcon_maestro2"].skip_reason.str.startswith("not selected: scanner topcon_maestro2").all()
    assert df[(df.device == "zeiss_cirrus") & df.protocol.str.contains("disc")].skip_reason.str.startswith(
        "not selected: region optic disc").all()
    # configs/cache.yaml resamples to one voxel size: every volume's is the config's, its cut or pad recorded
    cfg = config.load(CacheConfig, "configs/cache.yaml")
    assert cfg.preprocess.resample == "spacing"
    assert all(list(v) == list(cfg.preprocess.spacing_mm) for v in ok.spacing_mm) and ok.crop_pad.notna().all()
    # protocols in any spelling
    sel = config.load(CacheConfig, None, ["select.protocol=[Maestro2_3D_Wide_OCT]"]).select
    assert sel.skip_reason({"protocol": "maestro2 3d wide oct", "scan_pattern": "raster"}) is None
    assert sel.skip_reason({"protocol": "maestro2 3d macula oct", "scan_pattern": "raster"}).startswith(
        "not selected: protocol maestro2 3d macula oct")
    with pytest.raises(config.ConfigError, match="select.scan_pattern"):
        config.load(CacheConfig, "configs/cache.yaml", ["select.scan_pattern=[cube]"])


@pytest.mark.slow  # three cache builds, about 6 s: the heavy lane
def test_a_selection_changed_later_reuses_the_headers_reading(tmp_path, capsys):
    """Rows read once keep their header's reading: widening `select` caches the radial scans
    without re-reading the others, narrowing it again skips them without reading anything."""
    root = tree(tmp_path, participants=4)
    cache = str(tmp_path / "cache")
    # grid: a radial scan has no extent across its frames, so only a stretch can cache it (spacing fails it)
    base = config.load(CacheConfig, "configs/cache.yaml", [SHAPE, "preprocess.resample=grid"])
    first = pd.DataFrame(cache_build.build(root, cache, base, progress=False))
    radial = (first.scan_pattern == "radial").sum()
    wide = config.load(CacheConfig, "configs/cache.yaml", [SHAPE, "preprocess.resample=grid",
                                                           "select.scan_pattern=[raster,radial]"])
    capsys.readouterr()
    second = pd.DataFrame(cache_build.build(root, cache, wide, progress=False))
    assert (second.status == "ok").all() and (second.status == "ok").sum() == (first.status == "ok").sum() + radial
    assert f"{len(first) - radial} reused, {radial} processed" in capsys.readouterr().out   # only the radial ones read
    third = pd.DataFrame(cache_build.build(root, cache, base, progress=False))
    assert list(third.status) == list(first.status)
    assert f"{len(first)} reused, 0 processed" in capsys.readouterr().out                 # nothing read


def test_a_tree_regenerated_in_the_same_folder_is_read_anew(tmp_path, capsys):
    """The cache is keyed on the source's listing, not its path: a second build of the unchanged tree
    reuses every row and the learning check's pretraining run, named for its cache, keeps its name (it
    resumes); the same folder regenerated with other participants rebuilds sources.parquet, caches
    exactly the new files, and names another run."""
    from check import run_names

    root = tree(tmp_path, participants=8)
    cache = str(tmp_path / "cache")
    cfg = config.load(CacheConfig, "configs/cache.yaml", [SHAPE])
    cache_build.build(root, cache, cfg, progress=False)
    before = run_names.recipe_name("configs/pretrain_check.yaml", cache, [])
    capsys.readouterr()
    again = cache_build.build(root, cache, cfg, progress=False)           # the second run: nothing changed
    assert f"{len(again)} reused, 0 processed" in capsys.readouterr().out
    assert run_names.recipe_name("configs/pretrain_check.yaml", cache, []) == before   # the same run: it resumes
    tree(tmp_path, participants=6, seed=9)                   # same path, other files
    stored = cache_build.paths.read_sources(cache)[0]
    capsys.readouterr()
    # one shard of several keeps the stored rows (every host must split the same ones) and says so
    assert cache_build.load_sources(root, cache, shards=2) == stored
    assert "changed since" in capsys.readouterr().err
    rows = pd.DataFrame(cache_build.build(root, cache, cfg, progress=False))
    assert "changed since" in capsys.readouterr().out
    now, _ = rows_by_relpath(root)
    assert sorted(rows.relpath) == list(now.index)
    assert all((tmp_path / "plain" / rel).exists() for rel in rows.relpath)
    assert run_names.recipe_name("configs/pretrain_check.yaml", cache, []) != before


def test_the_manifest_summary_previews_the_cache(tmp_path):
    root = tree(tmp_path, participants=4)
    r = run_cli("manifests.build", "--source", root, "--out", str(tmp_path / "sources.parquet"))
    assert r.returncode == 0, r.stderr
    src, _ = rows_by_relpath(root)
    assert "layout: as released" in r.stdout and f"{len(src)} found at their path" in r.stdout
    assert f"protocol told by the file name: {len(src)} row(s)" in r.stdout
    r = run_cli("cache.preview", "--cache", str(tmp_path), "--config", "configs/cache.yaml", SHAPE)   # make manifest's last step
    assert r.returncode == 0, r.stderr
    n = (src.scan_pattern == "raster").sum()
    assert f"cache: up to {n} volumes at 8x32x32" in r.stdout and f"{(src.scan_pattern == 'radial').sum()} files skipped" in r.stdout


def test_expand_writes_a_repacked_buckets_members_at_the_manifests_paths(tmp_path):
    repack = tree(tmp_path, "repack", participants=4, layout="repack")
    r = run_cli("ingest.expand", "--source", repack, "--dst", str(tmp_path / "plain_again"), "--no-progress", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    got, summary = rows_by_relpath(str(tmp_path / "plain_again"))
    assert summary["by_path"] == len(got) and summary["by_name"] == 0 and got.manifest_error.isna().all()


def test_a_skip_decided_by_name_leaves_the_header_to_decide_later(tmp_path):
    """A row skipped before its file was read (here by device) keeps no reading of the scan: under a
    selection that wants it, its header decides (a raster file whose name says no protocol is cached),
    exactly as on a fresh cache."""
    root = tree(tmp_path, participants=4)
    victim = next(p for p in (tmp_path / "plain").rglob("*spectralis_ppol*_r_*.dcm"))
    tsv = f"{root}/retinal_oct/manifest.tsv"
    df = pd.read_csv(tsv, sep="\t", dtype=str, keep_default_na=False)
    rel = str(victim.relative_to(tmp_path / "plain"))
    renamed = victim.with_name("scan_without_a_protocol.dcm")
    victim.rename(renamed)
    df.loc[df.filepath == "/" + rel, "filepath"] = "/" + str(renamed.relative_to(tmp_path / "plain"))
    df.to_csv(tsv, sep="\t", index=False)
    cache = str(tmp_path / "cache")
    only_triton = config.load(CacheConfig, None, [SHAPE, "select.scanner=[topcon_triton]"])
    first = {r["relpath"]: r for r in cache_build.build(root, cache, only_triton, progress=False)}
    key = str(renamed.relative_to(tmp_path / "plain"))
    assert first[key]["status"] == "skipped" and first[key]["skip_reason"].startswith("not selected: scanner")
    again = {r["relpath"]: r for r in cache_build.build(root, cache, config.load(CacheConfig, None, [SHAPE]),
                                                         progress=False)}
    assert again[key]["status"] == "ok" and again[key]["scan_pattern"] == "raster", again[key]["skip_reason"]


def test_a_header_name_the_table_does_not_know_keeps_the_file_names_protocol(tmp_path):
    """Zeiss keeps its own Protocol Name in Cirrus headers, which no public file shows: a name the table does
    not know leaves the file name's known protocol, its published pattern and field, in place."""
    from cache.worker import process_row
    from ingest import phantom
    from manifests.protocols import PROTOCOLS

    spec, protocol = synth.DEVICES["zeiss_cirrus"], PROTOCOLS["cirrus mac oct"]
    vol = phantom.make_volume((8, 64, 32), np.random.default_rng(3), "L")
    ds = synth.make_dataset(vol, spec, (0.75, 0.002, 0.1875), participant="1", laterality="L", sop_uid="1.2.3.9",
                            study_uid="1.2", series_uid="1.2.4", protocol_name="Cube Scan of Another Name")
    path = tmp_path / protocol.file_name("1", "L", "1.2.3.9")
    path.write_bytes(synth.dicom_bytes(ds))
    row = {"relpath": f"retinal_oct/structural_oct/zeiss_cirrus/1/{path.name}", "source": str(path), "cache_key": "k",
           "device": "zeiss_cirrus", "protocol": protocols.from_file_name(path.name)}
    out = process_row(row, config.to_dict(config.load(CacheConfig, None, [SHAPE])), str(tmp_path / "c"), "t")
    assert out["status"] == "ok" and out["protocol"] == protocol.name and out["scan_pattern"] == "raster", out
    assert out["protocol_by"] == "name"
    assert out["field_mm"][0] == pytest.approx(6.0) and out["protocol_mismatch"] is None


def test_the_cache_key_holds_spacing_mm_only_where_it_shapes_the_volume():
    """Under `grid`, spacing_mm changes no byte: a config edit there must not rebuild a grid cache (the
    learning check's cohorts) from scratch; under `spacing` it must."""
    row = {"relpath": "retinal_oct/x.dcm", "size": 1, "source_version": "v"}

    def key(**pre):
        return cache_build.cache_key(row, config.from_dict(CacheConfig, {"preprocess": pre}))

    assert key(resample="grid", spacing_mm=[0.1, 0.006, 0.02]) == key(resample="grid", spacing_mm=[0.2, 0.006, 0.02])
    assert key(resample="spacing", spacing_mm=[0.1, 0.006, 0.02]) != key(resample="spacing", spacing_mm=[0.2, 0.006, 0.02])

import pandas as pd
import pytest

from ingest import synth
from manifests import build, splits
from manifests.aireadi import STUDY_GROUPS
from octfm import fsio
from octfm.errors import DataError


def make_tree(tmp_path, **kw):
    root = tmp_path / "ds"
    synth.generate(root, synth.SynthConfig(participants=kw.pop("participants", 12), scale=16, seed=3, **kw))
    return root


def test_rows_labels_and_reasons(tmp_path):
    root = make_tree(tmp_path)
    rows, summary = build.build_sources(str(root))
    df = pd.DataFrame(rows)
    assert len(df) == len(pd.read_csv(root / "retinal_oct" / "manifest.tsv", sep="\t"))
    missing = df[df.relpath.str.contains("bad_missing")]
    assert missing.manifest_error.iloc[0].startswith("missing:")
    unlabeled = df[df.study_group.isna()]
    assert len(unlabeled) > 0 and unlabeled.label.isna().all() and unlabeled.split.notna().all()
    labeled = df[df.study_group.notna()]
    assert (labeled.label == labeled.study_group.map(STUDY_GROUPS.index)).all()
    assert set(df.device) == {"heidelberg_spectralis", "topcon_maestro2", "topcon_triton", "zeiss_cirrus"}
    assert splits.split_leaks(df) == []


def test_person_id_and_fallback_split_have_no_leaks(tmp_path):
    root = make_tree(tmp_path, participants=40, id_column="person_id", split_column=False, bad_files=False)
    rows, summary = build.build_sources(str(root), seed=7)
    df = pd.DataFrame(rows)
    assert summary["resplit"] == 40
    assert splits.split_leaks(df) == []
    per_person = df.groupby("participant_id").split.first().value_counts(normalize=True)
    assert per_person["train"] == pytest.approx(0.70, abs=0.1)
    assert per_person["val"] == pytest.approx(0.15, abs=0.1) and per_person["test"] == pytest.approx(0.15, abs=0.1)
    again = pd.DataFrame(build.build_sources(str(root), seed=7)[0])
    assert (again.split == df.split).all(), "the fallback split must be deterministic"


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "gs://other-bucket/x.dcm",
                                 "/retinal_oct/../../secret.dcm", "retinal_oct\\..\\x.dcm"])
def test_paths_that_leave_the_root_become_failed_rows(tmp_path, bad):
    root = make_tree(tmp_path, participants=4, bad_files=False)
    tsv = root / "retinal_oct" / "manifest.tsv"
    df = pd.read_csv(tsv, sep="\t", dtype=str, keep_default_na=False)
    df.loc[0, "filepath"] = bad
    df.to_csv(tsv, sep="\t", index=False)
    rows, _ = build.build_sources(str(root))
    row = [r for r in rows if r["relpath"] == bad][0]
    assert row["manifest_error"].startswith("bad path") and row["source"] is None


def test_safe_relpath_accepts_aireadi_form():
    assert fsio.safe_relpath("/retinal_oct/structural_oct/a/b.dcm", "retinal_oct") == "retinal_oct/structural_oct/a/b.dcm"
    with pytest.raises(fsio.PathEscapeError):
        fsio.safe_relpath("/retinal_oct/../participants.tsv", "retinal_oct")


def test_missing_column_names_file_and_column(tmp_path):
    root = make_tree(tmp_path, participants=4, bad_files=False)
    p = root / "participants.tsv"
    df = pd.read_csv(p, sep="\t", dtype=str)
    df.drop(columns=["study_group"]).to_csv(p, sep="\t", index=False)
    with pytest.raises(DataError, match=r"participants.tsv: missing column\(s\) study_group"):
        build.build_sources(str(root))


def test_unlisted_dicom_is_kept(tmp_path):
    root = make_tree(tmp_path, participants=4, bad_files=False)
    extra = root / "retinal_oct/structural_oct/topcon_triton/1001/extra.dcm"
    extra.parent.mkdir(parents=True, exist_ok=True)
    extra.write_bytes(b"x")
    rows, summary = build.build_sources(str(root))
    row = [r for r in rows if r["relpath"].endswith("extra.dcm")][0]
    assert row["listed"] is False and row["participant_id"] == "1001" and summary["unlisted"] == 1


def test_manifest_cli_writes_parquet(tmp_path):
    from conftest import run_cli

    root = make_tree(tmp_path, participants=4)
    out = tmp_path / "sources.parquet"
    r = run_cli("manifests.build", "--source", str(root), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "rows that cannot be cached: 1 missing" in r.stdout
    assert len(pd.read_parquet(out)) > 0
    r = run_cli("manifests.build", "--source", str(root), "--out", str(out), "--strict")
    assert r.returncode == 3
    r = run_cli("manifests.build", "--source", str(tmp_path / "nowhere"), "--out", str(out))
    assert r.returncode == 2 and "participants.tsv not found" in r.stderr


def test_unknown_study_group_gets_a_null_label_and_a_warning(tmp_path):
    root = make_tree(tmp_path, participants=4, bad_files=False, unlabeled=0)
    p = root / "participants.tsv"
    df = pd.read_csv(p, sep="\t", dtype=str)
    df.loc[0, "study_group"] = "prediabetes_typo"
    df.to_csv(p, sep="\t", index=False)
    rows, summary = build.build_sources(str(root))
    mine = [r for r in rows if r["participant_id"] == df.participant_id[0]]
    assert mine and all(r["label"] is None and r["manifest_error"] is None for r in mine)
    assert any("unknown study_group value(s) ['prediabetes_typo']" in w for w in summary["warnings"])
    assert all(r["label"] is not None for r in rows if r["participant_id"] != df.participant_id[0])


def test_duplicate_participants_identical_kept_once_conflicting_refused(tmp_path):
    root = make_tree(tmp_path, participants=4, bad_files=False)
    p = root / "participants.tsv"
    df = pd.read_csv(p, sep="\t", dtype=str, keep_default_na=False)
    pd.concat([df, df.iloc[[1]]]).to_csv(p, sep="\t", index=False)
    rows, summary = build.build_sources(str(root))
    assert summary["participants"] == 4 and any("listed twice" in w for w in summary["warnings"])
    assert len(rows) == len(pd.read_csv(root / "retinal_oct" / "manifest.tsv", sep="\t"))
    changed = df.iloc[[1]].copy()
    changed["study_group"] = "insulin_dependent" if df.study_group[1] != "insulin_dependent" else "healthy"
    pd.concat([df, changed]).to_csv(p, sep="\t", index=False)
    with pytest.raises(DataError, match=rf"participants.tsv: participant_id listed more than once with different "
                                         rf"values: {df.participant_id[1]}"):
        build.build_sources(str(root))


def test_duplicate_uids_across_manifest_parts_fail_when_read_together(tmp_path, capsys):
    """Two shards each hold one copy of an image (an unlisted file's header UID): each part alone
    is clean, the manifest read whole keeps the first relpath and fails the other, naming the pair."""
    from manifests import paths, schema
    from octfm import fsio

    rows = [{"relpath": "retinal_oct/a/1.dcm", "status": "ok", "sop_instance_uid": "1.2.3", "volume": "v/1"},
            {"relpath": "retinal_oct/b/2.dcm", "status": "ok", "sop_instance_uid": "1.2.3", "volume": "v/2"},
            {"relpath": "retinal_oct/c/3.dcm", "status": "ok", "sop_instance_uid": "4.5.6", "volume": "v/3"}]
    for i, part in enumerate([[rows[0], rows[2]], [rows[1]]]):
        fsio.write_parquet_atomic(schema.to_table(part, schema.CACHE_SCHEMA), paths.part_uri(str(tmp_path), (i, 2)))
    (tmp_path / "manifest.parquet" / ".part-0000-of-0002.parquet.tmp-s0-dead").write_bytes(b"torn")  # skipped
    got = {r["relpath"]: r for r in paths.read_manifest_table(str(tmp_path)).to_pylist()}
    assert len(got) == 3 and got["retinal_oct/a/1.dcm"]["status"] == "ok" and got["retinal_oct/c/3.dcm"]["status"] == "ok"
    assert got["retinal_oct/b/2.dcm"]["status"] == "failed" and got["retinal_oct/b/2.dcm"]["volume"] is None
    assert got["retinal_oct/b/2.dcm"]["error"] == "duplicate SOP instance UID: 1.2.3 is also retinal_oct/a/1.dcm"
    assert "retinal_oct/b/2.dcm repeats retinal_oct/a/1.dcm" in capsys.readouterr().err


README_RUNNER = r"""
import ast, json, sys
block = sys.stdin.read()
ns, results = {}, []
for node in ast.parse(block).body:
    if isinstance(node, ast.Expr):
        results.append(eval(compile(ast.Expression(node.value), "<README>", "eval"), ns))
    else:
        exec(compile(ast.Module([node], []), "<README>", "exec"), ns)
counts, failures, joined = results
df, vol = ns["df"], ns["vol"]
print(json.dumps({"counts": {f"{d}/{s}": int(n) for (d, s), n in counts.items()},
                  "failures": failures.error.tolist(), "joined": len(joined), "rows": len(df),
                  "joined_cols": list(joined.columns), "label": str(df.label.dtype),
                  "vol": [str(vol.dtype), list(vol.shape)]}))
"""


def readme_pandas_block() -> str:
    from conftest import REPO

    text = (REPO / "README.md").read_text()
    start = text.index("```python\nimport pandas as pd; from cache import store\n") + len("```python\n")
    return text[start:text.index("```", start)]


def test_the_readme_pandas_lines_run_as_written(synth_tree, tmp_path):
    """The five lines, verbatim, in a folder laid out as after `make demo`."""
    import json
    import subprocess
    import sys

    from conftest import SMALL, run_here

    (tmp_path / "data" / "demo").mkdir(parents=True)
    (tmp_path / "data" / "demo" / "gcs").symlink_to(synth_tree, target_is_directory=True)
    r = run_here("cache.build", "--source", str(synth_tree), "--cache", str(tmp_path / "data" / "cache"),
                 "--no-progress", *SMALL)
    assert r.returncode == 0, r.stderr
    block = readme_pandas_block()
    lines = [line for line in block.splitlines() if line.strip()]
    assert lines[0].startswith("import") and len(lines[1:]) == 5
    p = subprocess.run([sys.executable, "-c", README_RUNNER], input=block, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert sum(out["counts"].values()) > 0 and {k.split("/")[1] for k in out["counts"]} <= {"train", "val", "test"}
    assert out["failures"] and all(": " in e or e for e in out["failures"])  # synth_tree has bad files
    assert out["joined"] == out["rows"]  # every row's participant is in participants.tsv
    assert "recommended_split" in out["joined_cols"] and out["label"] == "Int64"
    assert out["vol"] == ["uint8", [16, 48, 48]]

    df = pd.read_parquet(tmp_path / "data" / "cache" / "manifest.parquet")
    assert str(df.label.dtype) == "Int64" and str(df.age.dtype) == "Int64" and df.label.isna().any()
    assert set(df.label.dropna()) <= {0, 1, 2, 3} and df.age.notna().any()
    assert df.study_visit_date.dropna().str.match(r"\d{4}-\d{2}-\d{2}$").all()
    assert {"Varies by frame", "Not reported"} <= set(df.pixel_spacing) | set(df.slice_thickness)
    assert "reference_filepath" in df.columns
    ok = df[df.status == "ok"]
    assert ok["shape"].map(lambda s: s.dtype.kind == "i").all() and ok["spacing_mm"].map(lambda s: s.dtype.kind == "f").all()

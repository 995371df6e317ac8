"""The AI-READI tables: participants.tsv and retinal_oct/manifest.tsv, and their vocabulary."""
from __future__ import annotations

import io
import re

import pandas as pd

from octfm.errors import DataError

# The 4-class label (label = index), in AI-READI's order of disease severity (docs/architecture.md).
STUDY_GROUPS = (
    "healthy",
    "pre_diabetes_lifestyle_controlled",
    "oral_medication_and_or_non_insulin_injectable_medication_controlled",
    "insulin_dependent",
)
DEVICES = ("heidelberg_spectralis", "topcon_maestro2", "topcon_triton", "zeiss_cirrus")
SPLITS = ("train", "val", "test")
# Probe tasks on the label: the trainer's online probe (train/) and the offline probes (evals/) share them.
TASKS = {
    "study_group": {"classes": 4, "names": list(STUDY_GROUPS), "map": lambda label: label},
    # diabetic: oral medication / non-insulin injectable (2) or insulin dependent (3) vs not
    "diabetic": {"classes": 2, "names": ["not_diabetic", "diabetic"], "map": lambda label: int(label >= 2)},
}
SITES = ("UW", "UAB", "UCSD")

PARTICIPANT_COLUMNS = ("participant_id", "study_group")
OCT_COLUMNS = ("participant_id", "filepath")

_MODEL_DEVICE = (
    (re.compile(r"spectralis", re.I), "heidelberg_spectralis"),
    (re.compile(r"maestro", re.I), "topcon_maestro2"),
    (re.compile(r"triton", re.I), "topcon_triton"),
    (re.compile(r"cirrus", re.I), "zeiss_cirrus"),
)
# Heidelberg and Zeiss each contribute one device here; Topcon has two, so it needs the model.
_MANUFACTURER_DEVICE = ((re.compile(r"heidelberg", re.I), "heidelberg_spectralis"),
                        (re.compile(r"zeiss", re.I), "zeiss_cirrus"))


def read_tsv(text: str, where: str) -> pd.DataFrame:
    """Parse a TSV with every column as string (IDs such as 1001 must stay strings)."""
    try:
        df = pd.read_csv(io.StringIO(text), sep="\t", dtype=str, keep_default_na=False)
    except Exception as exc:  # pandas raises several parser error types
        raise DataError(f"{where}: cannot parse as TSV: {exc}") from exc
    df.columns = [c.strip() for c in df.columns]
    return df.apply(lambda col: col.str.strip())


def _require(df: pd.DataFrame, columns, where: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DataError(f"{where}: missing column(s) {', '.join(missing)}; found {', '.join(df.columns)}")


def parse_participants(text: str, where: str = "participants.tsv") -> tuple[pd.DataFrame, list[str]]:
    """participants.tsv -> one row per participant with `label` (nullable) and `split`.

    Release 3 renamed participant_id to person_id: both are accepted. Returns the table and
    warnings (unknown study groups, bad split values) for the command summary.
    """
    df = read_tsv(text, where)
    if "participant_id" not in df.columns and "person_id" in df.columns:
        df = df.rename(columns={"person_id": "participant_id"})
    _require(df, PARTICIPANT_COLUMNS, where)
    warnings: list[str] = []
    df = df[df["participant_id"] != ""].copy()
    dup = df[df.duplicated("participant_id", keep=False)]
    if len(dup):
        conflicting = dup.groupby("participant_id").filter(lambda g: len(g.drop_duplicates()) > 1)
        if len(conflicting):
            ids = sorted(conflicting["participant_id"].unique())[:10]
            raise DataError(f"{where}: participant_id listed more than once with different values: {', '.join(ids)}")
        warnings.append(f"{where}: {dup['participant_id'].nunique()} participant(s) listed twice with identical rows (kept once)")
        df = df.drop_duplicates("participant_id")
    groups = df["study_group"].str.lower()
    known = groups.isin(STUDY_GROUPS)
    unknown = sorted(set(groups[~known & (groups != "")]))
    if unknown:
        warnings.append(f"{where}: unknown study_group value(s) {unknown}: those participants get a null label")
    df["study_group"] = groups.where(groups != "", None)
    df["label"] = [STUDY_GROUPS.index(g) if g in STUDY_GROUPS else None for g in groups]
    df["label"] = df["label"].astype("Int8")
    if "recommended_split" in df.columns:
        split = df["recommended_split"].str.lower()
        bad = sorted(set(split[~split.isin(SPLITS) & (split != "")]))
        if bad:
            warnings.append(f"{where}: recommended_split value(s) {bad} are not train/val/test: re-split those participants")
        df["split"] = split.where(split.isin(SPLITS), None)
    else:
        df["split"] = None
    if "clinical_site" not in df.columns:
        df["clinical_site"] = None
    return df.reset_index(drop=True), warnings


def parse_oct_manifest(text: str, where: str = "retinal_oct/manifest.tsv") -> pd.DataFrame:
    """retinal_oct/manifest.tsv -> one row per listed DICOM (columns kept as strings)."""
    df = read_tsv(text, where)
    if "participant_id" not in df.columns and "person_id" in df.columns:
        df = df.rename(columns={"person_id": "participant_id"})
    _require(df, OCT_COLUMNS, where)
    for col in ("manufacturer", "manufacturers_model_name", "anatomic_region", "imaging", "laterality",
                "height", "width", "number_of_frames", "sop_instance_uid", "pixel_spacing", "slice_thickness",
                "reference_filepath"):
        if col not in df.columns:
            df[col] = ""
    return df


def device_from_path(relpath: str, manufacturer: str = "", model: str = "") -> str | None:
    """The device folder in the path (AI-READI layout), else a guess from the header names."""
    for part in relpath.split("/"):
        if part in DEVICES:
            return part
    for pattern, device in _MODEL_DEVICE:
        if pattern.search(model or ""):
            return device
    for pattern, device in _MANUFACTURER_DEVICE:
        if pattern.search(manufacturer or ""):
            return device
    return None


def normalize_laterality(value: str | None) -> str | None:
    v = (value or "").strip().upper()
    if v in ("R", "RIGHT", "OD"):
        return "R"
    if v in ("L", "LEFT", "OS"):
        return "L"
    return None

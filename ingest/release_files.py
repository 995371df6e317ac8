"""One release file as AI-READI's converters write it (docs/data.md, "Scan protocols"): an OPT
multi-frame dataset with the converters' Protocol Name, spacing in the shared functional groups (per
frame on the radial scan, without Slice Thickness), Cirrus's Slice Thickness overwritten with the
column spacing, each frame's trace on the localizer (none on Heidelberg's own Spectralis OCTA
export), and the acquisition's other modalities (a flow cube, an infrared photo) beside it. The
synthetic tree (ingest/synth.py) is written from these.
"""
from __future__ import annotations

import copy
import dataclasses
import io
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.uid import ExplicitVRLittleEndian, JPEG2000Lossless, generate_uid

from manifests.protocols import RADIAL, Protocol

OPT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.5.4"


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    shape: tuple[int, int, int]          # frames, rows, cols at native size
    spacing: tuple[float, float, float]  # mm: between frames, rows, cols
    manufacturer: str
    model: str
    short: str
    compress: str | None = None          # transfer syntax to write
    # AI-READI's Cirrus converter overwrites Slice Thickness with the column spacing (docs/data.md, "Scan protocols")
    thickness_is_column_spacing: bool = False


DEVICES = {
    d.name: d for d in (
        DeviceSpec("heidelberg_spectralis", (61, 496, 768), (0.1200, 0.0039, 0.0114), "Heidelberg Engineering",
                   "Spectralis", "spectralis"),
        DeviceSpec("topcon_maestro2", (128, 885, 512), (0.0469, 0.0026, 0.0117), "Topcon", "Maestro2", "maestro2"),
        DeviceSpec("topcon_triton", (256, 992, 512), (0.0469, 0.0026, 0.0234), "Topcon", "Triton", "triton"),
        DeviceSpec("zeiss_cirrus", (128, 1024, 512), (0.0469, 0.0020, 0.0117), "Carl Zeiss Meditec", "Cirrus HD-OCT 5000",
                   "cirrus", compress=JPEG2000Lossless, thickness_is_column_spacing=True),
    )
}
OCTA_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.5.8"    # OCT B-scan Volume Analysis: an OCTA flow cube
PHOTO_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.5.1"   # Ophthalmic Photography 8 Bit
LOCALIZER_MM = 0.0115  # mm per pixel of the notional localizer image the frames' traces are drawn on


def has_traces(protocol: Protocol) -> bool:
    """Whether release files of this protocol carry their frames' traces (Ophthalmic Frame Location): AI-READI's
    converters write or copy them for every protocol but Spectralis OCTA, Heidelberg's own export, whose traces
    no public file shows; the generator leaves them out there, so its documented reversal is what orients it."""
    return not protocol.frames_reversed


def localizer_traces(protocol: Protocol, frames: int, cols: int, spacing, reverse: bool = False) -> list[list[float]]:
    """Each frame's trace on a localizer image, as DICOM's Reference Coordinates (row, column pairs):
    a raster's lines top to bottom (bottom to top when `reverse`: the file's frames then run up),
    a radial scan's lines through one centre at evenly spread angles."""
    width = cols * spacing[2] / LOCALIZER_MM
    centre = 384.0
    out = []
    for k in range(frames):
        if protocol.pattern == RADIAL:
            angle = np.pi * k / frames
            dr, dc = width / 2 * np.sin(angle), width / 2 * np.cos(angle)
            out.append([centre - dr, centre - dc, centre + dr, centre + dc])
            continue
        height = (frames - 1) * spacing[0] / LOCALIZER_MM
        row = centre - height / 2 + height * ((frames - 1 - k) if reverse else k) / max(frames - 1, 1)
        out.append([row, centre - width / 2, row, centre + width / 2])
    return [[round(v, 3) for v in t] for t in out]


def _functional_group(spacing: tuple[float, float, float], thickness: bool = True) -> Dataset:
    pm = Dataset()
    pm.PixelSpacing = [f"{spacing[1]:.6g}", f"{spacing[2]:.6g}"]
    if thickness:
        pm.SliceThickness = f"{spacing[0]:.6g}"
    fg = Dataset()
    fg.PixelMeasuresSequence = DicomSequence([pm])
    return fg


def header_spacing(spec: DeviceSpec, spacing: tuple[float, float, float]) -> tuple[float, float, float]:
    """The (frame, row, col) spacing a release header states: the true one, but on Cirrus, whose converter
    overwrites Slice Thickness with the column spacing."""
    return (spacing[2], spacing[1], spacing[2]) if spec.thickness_is_column_spacing else tuple(spacing)


def per_frame_spacing(protocol: Protocol) -> bool:
    """Spectralis's radial scans keep Pixel Spacing per frame, without Slice Thickness; every other
    protocol has both in the shared functional groups (docs/data.md, "Scan protocols")."""
    return protocol.pattern == RADIAL


def tsv_spacing(spec: DeviceSpec, protocol: Protocol, spacing) -> dict[str, str]:
    """manifest.tsv's pixel_spacing and slice_thickness strings as AI-READI's metadata step writes them: the
    shared functional groups' values (Cirrus's overwritten thickness included), "Varies by frame" and "Not
    reported" where spacing is per frame."""
    f, r, c = header_spacing(spec, spacing)
    if per_frame_spacing(protocol):
        return {"pixel_spacing": "Varies by frame", "slice_thickness": "Not reported"}
    return {"pixel_spacing": f"{r:g}\\{c:g}", "slice_thickness": f"{f:g}"}


def _frame_location(trace: list[float]) -> Dataset:
    loc = Dataset()
    loc.ReferenceCoordinates = trace
    loc.OphthalmicImageOrientation = "LINEAR"
    return loc


def make_dataset(vol: np.ndarray, spec: DeviceSpec, spacing: tuple[float, float, float], *,
                 participant: str, laterality: str, sop_uid: str, study_uid: str, series_uid: str,
                 protocol_name: str | None = None, traces: list[list[float]] | None = None,
                 per_frame: bool = False, sop_class: str = OPT_SOP_CLASS) -> Dataset:
    """An OPT (Ophthalmic Tomography) multi-frame dataset holding `vol`, uncompressed; with
    Protocol Name and each frame's Ophthalmic Frame Location when given. `spacing` is what the
    header states: in the shared functional groups, or each frame's without Slice Thickness (`per_frame`)."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = sop_class
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = sop_class, sop_uid
    ds.StudyInstanceUID, ds.SeriesInstanceUID = study_uid, series_uid
    ds.Modality = "OPT"
    ds.PatientID = participant
    ds.Manufacturer, ds.ManufacturerModelName = spec.manufacturer, spec.model
    ds.ImageLaterality = laterality
    ds.Laterality = laterality
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.NumberOfFrames = vol.shape[0]
    ds.Rows, ds.Columns = vol.shape[1], vol.shape[2]
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    if protocol_name:
        ds.ProtocolName = protocol_name
    groups = [_functional_group(spacing, thickness=False) if per_frame else Dataset() for _ in range(vol.shape[0])]
    if not per_frame:
        ds.SharedFunctionalGroupsSequence = DicomSequence([_functional_group(spacing)])
    for group, trace in zip(groups, traces or ()):
        group.OphthalmicFrameLocationSequence = DicomSequence([_frame_location(trace)])
    if per_frame or traces:
        ds.PerFrameFunctionalGroupsSequence = DicomSequence(groups)
    ds.PixelData = np.ascontiguousarray(vol).tobytes()
    return ds


def dicom_bytes(ds: Dataset, compress: str | None = None) -> bytes:
    if compress:
        ds = copy.deepcopy(ds)
        # keep the SOP Instance UID manifest.tsv lists (pydicom would draw a random one)
        ds.compress(compress, encoding_plugin="pylibjpeg", generate_instance_uid=False)
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


OTHER_MODALITIES = {"flow_cube": ("retinal_octa/flow_cube", OCTA_SOP_CLASS, (4, 16, 16)),
                    "ir": ("retinal_photography/ir", PHOTO_SOP_CLASS, (1, 32, 32))}


def write_other_modalities(out: Path, spec: DeviceSpec, protocol: Protocol, pid: str, lat: str, uid: str) -> int:
    """An OCT scan's sibling files (small: only their names, classes and places matter), named as AI-READI's
    converters name them, `<pid>_<id>_<submodality>_<l|r>_<uid>.dcm`: its infrared localizer photo, and an OCTA
    scan's flow cube. Returns how many were written."""
    kinds = [k for k in OTHER_MODALITIES if k != "flow_cube" or protocol.name.endswith("octa")]  # flow: OCTA scans
    for k, (sub, (folder, sop_class, shape)) in enumerate((k, OTHER_MODALITIES[k]) for k in kinds):
        sibling = generate_uid(entropy_srcs=[uid, sub])
        vol = np.full(shape, 40 + 20 * k, np.uint8)
        ds = make_dataset(vol, spec, (0.05, 0.01, 0.01), participant=pid, laterality=lat, sop_uid=sibling,
                          study_uid=uid, series_uid=generate_uid(entropy_srcs=[sibling]),
                          protocol_name=protocol.header_name, sop_class=sop_class)
        ds.Modality = "OPT" if sop_class == OCTA_SOP_CLASS else "OP"
        path = out / folder / spec.name / pid / f"{pid}_{protocol.file_id}_{sub}_{lat.lower()}_{sibling}.dcm"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(dicom_bytes(ds))
    return len(kinds)


def compression(spec: DeviceSpec, protocol: Protocol, shape) -> str | None:
    """The device's transfer syntax for its volumes; uncompressed for the radial scan and for frames
    under 32 pixels a side (OpenJPEG refuses its default six resolutions on those)."""
    return spec.compress if protocol.pattern != RADIAL and min(shape[1:]) >= 32 else None

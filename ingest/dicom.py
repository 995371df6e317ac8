"""Read one OCT DICOM from bytes, validate it, and decode it with a chosen plugin.

Every refusal raises BadInput with a reason that starts with a short category
("not DICOM", "no PixelData", "frame count mismatch", ...) so manifests group failures.
Header checks run before any pixel allocation: absurd dimensions are refused up front.
"""
from __future__ import annotations

import dataclasses
import io
import warnings

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.pixels import get_decoder

OPT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.5.4"
# Ophthalmic tomography storage classes we accept as OCT sources (OPT, and OCT B-scan volume analysis).
OCT_SOP_CLASSES = {OPT_SOP_CLASS, "1.2.840.10008.5.1.4.1.1.77.1.5.8"}
DECODER_ORDER = ("gdcm", "pylibjpeg", "pillow")  # fastest first (docs/measurements.md)


class BadInput(Exception):
    """The file cannot become a cached volume; str() is the manifest reason."""


@dataclasses.dataclass
class Volume:
    pixels: np.ndarray                      # [frames, rows, cols], uint8 or uint16
    spacing_mm: tuple | None                # (frame, row, col) or None when absent
    transfer_syntax: str
    bits_stored: int
    sop_instance_uid: str | None
    laterality: str | None


def parse(data: bytes, where: str = "") -> pydicom.Dataset:
    """Parse the header and keep PixelData undecoded."""
    if len(data) == 0:
        raise BadInput("not DICOM: empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pydicom.dcmread(io.BytesIO(data), force=False)
    except InvalidDicomError as exc:
        raise BadInput(f"not DICOM: {exc}") from None
    except (EOFError, ValueError, OSError, KeyError, TypeError, IndexError) as exc:
        raise BadInput(f"truncated or corrupt header: {type(exc).__name__}: {exc}") from None


def check_header(ds: pydicom.Dataset, max_voxels: int, accept_any_sop: bool = False) -> tuple[int, int, int, int]:
    """Validate what the header promises; returns (frames, rows, cols, bits_allocated)."""
    sop = str(ds.get("SOPClassUID", ""))
    modality = str(ds.get("Modality", ""))
    if not accept_any_sop and sop not in OCT_SOP_CLASSES and modality != "OPT":
        raise BadInput(f"wrong SOP class: {sop or 'none'} (Modality {modality or 'none'}), expected "
                       f"Ophthalmic Tomography {OPT_SOP_CLASS} / OPT")
    if "PixelData" not in ds:
        raise BadInput("no PixelData: the file holds a header only")
    try:
        rows, cols = int(ds.Rows), int(ds.Columns)
        frames = int(ds.get("NumberOfFrames", 1) or 1)
        bits = int(ds.BitsAllocated)
        spp = int(ds.get("SamplesPerPixel", 1))
        photometric = str(ds.get("PhotometricInterpretation", ""))
    except (AttributeError, TypeError, ValueError) as exc:
        raise BadInput(f"bad image header: {exc}") from None
    if spp != 1 or photometric not in ("MONOCHROME2", "MONOCHROME1"):
        raise BadInput(f"not monochrome: SamplesPerPixel={spp}, PhotometricInterpretation={photometric or 'none'}")
    if bits not in (8, 16):
        raise BadInput(f"unsupported bit depth: BitsAllocated={bits} (8 or 16 expected)")
    if min(rows, cols, frames) < 1:
        raise BadInput(f"empty dimensions: frames={frames} rows={rows} cols={cols}")
    if frames * rows * cols > max_voxels:
        raise BadInput(f"dimensions too large: {frames}x{rows}x{cols} = {frames * rows * cols} voxels "
                       f"> limit {max_voxels} (config key preprocess.max_voxels)")
    return frames, rows, cols, bits


def check_native_length(ds: pydicom.Dataset, frames: int, rows: int, cols: int, bits: int) -> None:
    """For uncompressed data the byte count must match the header exactly (up to padding)."""
    if ds.file_meta.TransferSyntaxUID.is_compressed:
        return
    n = len(ds.PixelData)
    frame_bytes = rows * cols * bits // 8
    expected = frames * frame_bytes
    if n in (expected, expected + 1):
        return
    if n % frame_bytes == 0 and n > 0:
        raise BadInput(f"frame count mismatch: NumberOfFrames={frames} but PixelData holds {n // frame_bytes} frames")
    raise BadInput(f"truncated pixel data: {n} bytes, expected {expected} ({frames}x{rows}x{cols}x{bits // 8})")


def spacing_of(ds: pydicom.Dataset) -> tuple[float, float, float] | None:
    """(frame, row, col) spacing in mm from the shared or first per-frame functional group."""
    for seq_name in ("SharedFunctionalGroupsSequence", "PerFrameFunctionalGroupsSequence"):
        seq = ds.get(seq_name)
        if not seq:
            continue
        pm = seq[0].get("PixelMeasuresSequence")
        if not pm:
            continue
        m = pm[0]
        try:
            row_s, col_s = (float(v) for v in m.PixelSpacing)
        except (AttributeError, TypeError, ValueError):
            continue
        frame_s = m.get("SpacingBetweenSlices") or m.get("SliceThickness") or ds.get("SliceThickness")
        return (float(frame_s) if frame_s else float("nan"), row_s, col_s)
    if "PixelSpacing" in ds:
        try:
            row_s, col_s = (float(v) for v in ds.PixelSpacing)
            frame_s = ds.get("SpacingBetweenSlices") or ds.get("SliceThickness")
            return (float(frame_s) if frame_s else float("nan"), row_s, col_s)
        except (TypeError, ValueError):
            return None
    return None


def choose_plugin(ts, decoder: str = "auto") -> str:
    """The decoding plugin for a transfer syntax: the configured one if it can, else the
    fastest available (gdcm, pylibjpeg, pillow), else pydicom's own choice ("")."""
    if not ts.is_compressed:
        return ""
    try:
        available = get_decoder(ts).available_plugins
    except NotImplementedError:
        return ""
    for plugin in ((decoder,) if decoder != "auto" else ()) + DECODER_ORDER:
        if plugin in available:
            return plugin
    return ""


def decode(ds: pydicom.Dataset, frames: int, rows: int, cols: int, decoder: str = "auto") -> np.ndarray:
    """Decode pixels as [frames, rows, cols]; MONOCHROME1 is inverted to MONOCHROME2."""
    ts = ds.file_meta.TransferSyntaxUID
    opts = {"raw": True}
    plugin = choose_plugin(ts, decoder)
    if plugin:
        opts["decoding_plugin"] = plugin
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.pixel_array_options(**opts)
            arr = ds.pixel_array
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - vendor data breaks decoders in many ways
        raise BadInput(f"pixel data unreadable ({ts.name}, {plugin or 'default'} decoder): "
                       f"{type(exc).__name__}: {exc}") from None
    arr = arr.reshape((frames, rows, cols)) if arr.size == frames * rows * cols else None
    if arr is None:
        raise BadInput(f"frame count mismatch: decoded pixel data does not hold {frames}x{rows}x{cols}")
    if str(ds.get("PhotometricInterpretation")) == "MONOCHROME1":
        arr = arr.max() - arr if arr.dtype.kind == "i" else np.iinfo(arr.dtype).max - arr
    if arr.dtype.kind == "i":  # signed storage: shift to unsigned range keeping order
        arr = (arr.astype(np.int32) - int(arr.min())).astype(np.uint16)
    return arr


def read_volume(data: bytes, *, max_voxels: int = 512 * 1024 * 1024, decoder: str = "auto",
                accept_any_sop: bool = False) -> Volume:
    """Bytes of one DICOM -> validated Volume, or BadInput naming what was wrong."""
    ds = parse(data)
    frames, rows, cols, bits = check_header(ds, max_voxels, accept_any_sop)
    check_native_length(ds, frames, rows, cols, bits)
    pixels = decode(ds, frames, rows, cols, decoder)
    lat = ds.get("ImageLaterality") or ds.get("Laterality")
    return Volume(pixels=pixels, spacing_mm=spacing_of(ds), transfer_syntax=str(ds.file_meta.TransferSyntaxUID),
                  bits_stored=int(ds.get("BitsStored", bits)), sop_instance_uid=str(ds.get("SOPInstanceUID", "")) or None,
                  laterality=str(lat) if lat else None)

"""Read one OCT DICOM from bytes, validate it, and decode it with a chosen plugin.

Every refusal raises BadInput with a reason that starts with a short category
("not DICOM", "no PixelData", "frame count mismatch", ...) so manifests group failures.
Header checks run before any pixel allocation: absurd dimensions are refused up front.
"""
from __future__ import annotations

import dataclasses
import io
import struct
import warnings

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.pixels import get_decoder

from ingest import geometry

OPT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.5.4"
# Ophthalmic tomography storage classes we accept as OCT sources (OPT, and OCT B-scan volume analysis).
OCT_SOP_CLASSES = {OPT_SOP_CLASS, "1.2.840.10008.5.1.4.1.1.77.1.5.8"}
# Highest throughput first with every core decoding, as in the build's pool (docs/measurements.md; `make bench`)
DECODER_ORDER = ("pylibjpeg", "gdcm", "pillow")
PIXEL_DATA_TAG = b"\xe0\x7f\x10\x00"  # (7FE0,0010) little endian
LONG_LENGTH_VRS = {b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV"}


class BadInput(Exception):
    """The file cannot become a cached volume; str() is the manifest reason."""


@dataclasses.dataclass
class Header:
    """A file's validated header: what the pixels will be, and where the scan lies. Read before
    any pixel is decoded, so a file that will not be cached costs no decoding."""
    ds: pydicom.Dataset
    span: tuple[int, int] | None            # native PixelData's (offset, length) in the bytes, else None
    frames: int
    rows: int
    cols: int
    bits: int
    traces: list | None                     # each frame's trace on the localizer (ingest/geometry.py)

    @property
    def protocol_name(self) -> str | None:
        """Protocol Name (0018,1030), which AI-READI sets in every file."""
        v = self.ds.get("ProtocolName")
        return str(v) if v else None

    @property
    def spacing_mm(self) -> tuple | None:
        return spacing_of(self.ds)


@dataclasses.dataclass
class Volume:
    pixels: np.ndarray                      # [frames, rows, cols], uint8 or uint16
    spacing_mm: tuple | None                # (frame, row, col) or None when absent
    transfer_syntax: str
    bits_stored: int
    sop_instance_uid: str | None
    laterality: str | None
    protocol_name: str | None = None
    traces: list | None = None


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


def parse_native(data: bytes) -> tuple[pydicom.Dataset | None, tuple[int, int] | None]:
    """The header alone, and (offset, length) of native little-endian PixelData inside `data`,
    so pixels can be a view of the file's bytes instead of two more copies of them (pydicom's
    element value, then pixel_array). (None, None) when the data is compressed, big endian or
    not laid out as expected: the caller then lets pydicom read it all."""
    if len(data) == 0:
        return None, None
    fp = io.BytesIO(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = pydicom.dcmread(fp, force=False, stop_before_pixels=True)
        ts = ds.file_meta.TransferSyntaxUID
        if ts.is_compressed or not ts.is_little_endian:
            return None, None
    except Exception:  # noqa: BLE001 - parse() gives the reason
        return None, None
    pos = fp.tell()
    if data[pos:pos + 4] != PIXEL_DATA_TAG:
        return None, None
    if ts.is_implicit_VR:
        offset, length = pos + 8, struct.unpack_from("<I", data, pos + 4)[0]
    elif data[pos + 4:pos + 6] in LONG_LENGTH_VRS:
        offset, length = pos + 12, struct.unpack_from("<I", data, pos + 8)[0]
    else:
        offset, length = pos + 8, struct.unpack_from("<H", data, pos + 6)[0]
    if length == 0xFFFFFFFF:  # undefined length: encapsulated after all
        return None, None
    return ds, (offset, min(length, len(data) - offset))  # a short file reads short, as pydicom would


def check_header(ds: pydicom.Dataset, max_voxels: int, accept_any_sop: bool = False,
                 has_pixels: bool = False) -> tuple[int, int, int, int]:
    """Validate what the header promises; returns (frames, rows, cols, bits_allocated).
    `has_pixels`: PixelData was found outside `ds` (parse_native)."""
    sop = str(ds.get("SOPClassUID", ""))
    modality = str(ds.get("Modality", ""))
    if not accept_any_sop and sop not in OCT_SOP_CLASSES and modality != "OPT":
        raise BadInput(f"wrong SOP class: {sop or 'none'} (Modality {modality or 'none'}), expected "
                       f"Ophthalmic Tomography {OPT_SOP_CLASS} / OPT")
    if not has_pixels and "PixelData" not in ds:
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


def check_native_length(ds: pydicom.Dataset, frames: int, rows: int, cols: int, bits: int,
                        n: int | None = None) -> None:
    """For uncompressed data the byte count (`n`, else len(PixelData)) must match the header
    exactly (up to padding)."""
    if ds.file_meta.TransferSyntaxUID.is_compressed:
        return
    n = len(ds.PixelData) if n is None else n
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
    first available of DECODER_ORDER, else pydicom's own choice ("")."""
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
    return unsigned_monochrome2(ds, arr)


def native_view(ds: pydicom.Dataset, data: bytes, offset: int, frames: int, rows: int, cols: int,
                bits: int) -> np.ndarray:
    """Native little-endian pixels as a read-only view of the file's bytes (no copy)."""
    signed = int(ds.get("PixelRepresentation", 0)) == 1
    dtype = np.dtype(("<i" if signed else "<u") + str(bits // 8))
    arr = np.frombuffer(data, dtype=dtype, count=frames * rows * cols, offset=offset)
    return unsigned_monochrome2(ds, arr.reshape((frames, rows, cols)))


def unsigned_monochrome2(ds: pydicom.Dataset, arr: np.ndarray) -> np.ndarray:
    """MONOCHROME1 inverted to MONOCHROME2, signed storage shifted to unsigned (copies; rare)."""
    if str(ds.get("PhotometricInterpretation")) == "MONOCHROME1":
        arr = arr.max() - arr if arr.dtype.kind == "i" else np.iinfo(arr.dtype).max - arr
    if arr.dtype.kind == "i":  # signed storage: shift to unsigned range keeping order
        arr = (arr.astype(np.int32) - int(arr.min())).astype(np.uint16)
    return arr


def read_header(data: bytes, *, max_voxels: int = 512 * 1024 * 1024, accept_any_sop: bool = False) -> Header:
    """Bytes of one DICOM -> its validated Header (pixels not decoded), or BadInput."""
    ds, span = parse_native(data)
    if span is None:
        ds = parse(data)
    frames, rows, cols, bits = check_header(ds, max_voxels, accept_any_sop, has_pixels=span is not None)
    check_native_length(ds, frames, rows, cols, bits, None if span is None else span[1])
    return Header(ds, span, frames, rows, cols, bits, geometry.frame_traces(ds))


def decode_pixels(h: Header, data: bytes, decoder: str = "auto") -> Volume:
    """The header's pixels decoded (a view of `data` when native), as a Volume."""
    ds = h.ds
    if h.span is None:
        pixels = decode(ds, h.frames, h.rows, h.cols, decoder)
    else:
        pixels = native_view(ds, data, h.span[0], h.frames, h.rows, h.cols, h.bits)
    lat = ds.get("ImageLaterality") or ds.get("Laterality")
    return Volume(pixels=pixels, spacing_mm=spacing_of(ds), transfer_syntax=str(ds.file_meta.TransferSyntaxUID),
                  bits_stored=int(ds.get("BitsStored", h.bits)), sop_instance_uid=str(ds.get("SOPInstanceUID", "")) or None,
                  laterality=str(lat) if lat else None, protocol_name=h.protocol_name, traces=h.traces)


def decode_volume(data: bytes, *, max_voxels: int = 512 * 1024 * 1024, decoder: str = "auto",
                  accept_any_sop: bool = False) -> Volume:
    """Bytes of one DICOM -> validated Volume, or BadInput naming what was wrong."""
    return decode_pixels(read_header(data, max_voxels=max_voxels, accept_any_sop=accept_any_sop), data, decoder)

"""AI-READI's thirteen structural OCT scan protocols: what each one is (scanner, region, shape,
pattern, field, orientation), and how a file says which it is (its file name, its Protocol Name
(0018,1030), or its shape alone).

The facts come from the code AI-READI wrote the release with and from its documentation, each
cited in docs/data.md ("Scan protocols"). In short:
- A release file is `<participant>_<id>_<submodality>_<l|r>_<SOP Instance UID>.dcm`; the id is the
  converter's name for the protocol (`cirrus_mac_oct`, `maestro2_macula_6x6_octa`, ...) and the
  submodality `oct` for a structural cube (`flow_cube`, `enface`, `segmentation`, `ir`, ... for the
  other modalities the same acquisition yields).
- The header's Protocol Name is AI-READI's own ("maestro2 3d wide oct") on every scanner but
  Zeiss's: Cirrus files keep the name the instrument wrote.
- Only raster protocols sample a volume: a radial scan's B-scans cross at the disc centre, so
  resampling across them as neighbouring slices makes a meaningless cube; `make cache` skips them
  by default (configs/cache.yaml `select`).
"""
from __future__ import annotations

import dataclasses
import difflib
import re

RASTER, RADIAL, LINE = "raster", "radial", "line"
PATTERNS = (RASTER, RADIAL, LINE)
UNKNOWN = "unknown"   # what configs/cache.yaml `select` calls a scan whose pattern nothing tells
STRUCTURAL = "oct"    # the submodality of a structural cube in a release file name


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str                                   # AI-READI's name for it, as the manifest's `protocol` column holds it
    device: str                                 # the scanner (the release's folder name)
    region: str                                 # manifest.tsv's anatomic_region as AI-READI writes it
    shapes: tuple[tuple[int, int, int], ...]    # published frames x rows x columns
    pattern: str
    field_mm: tuple[float | None, float | None]  # published extent across frames, along columns (None: not published)
    file_id: str                                # the converter's id in release file names (before the submodality)
    header_names: tuple[str, ...] = ()          # Protocol Names written into headers (besides `name`)
    aliases: tuple[str, ...] = ()               # older spellings: earlier converters' ids, the documentation's names
    frames_reversed: bool = False               # AI-READI documents its frames as running opposite to other scanners'

    @property
    def header_name(self) -> str:
        """The Protocol Name a release file of this protocol carries: AI-READI's, or Zeiss's on Cirrus."""
        return self.header_names[0] if self.header_names else self.name

    def file_name(self, participant: str, laterality: str, uid: str) -> str:
        """The release's name of this protocol's structural cube."""
        return f"{participant}_{self.file_id}_{STRUCTURAL}_{laterality.lower()}_{uid}.dcm"


def _p(name, device, region, shapes, pattern, field=(None, None), file_id=None, header=(), aliases=(),
       reversed_=False) -> Protocol:
    return Protocol(name, device, region, tuple(shapes), pattern, field, file_id or "_".join(name.split()),
                    tuple(header), tuple(aliases), reversed_)


# Fields: a "12x9" scan is 12 mm along the B-scan (columns) and 9 mm across B-scans (frames). The mm come from
# the protocols' names and AI-READI's acquisition categories (docs/data.md); the documentation publishes none
# for Spectralis (its 20 x 20 is in degrees) or the Cirrus cubes' 512x128 and 200x200, which are 6 x 6 mm cubes
# by Zeiss's specification.
PROTOCOLS = {p.name: p for p in (
    _p("spectralis onh rc hr oct", "heidelberg_spectralis", "Optic Disc", [(27, 496, 768)], RADIAL,
       aliases=["spec onh rc hr oct"]),
    _p("spectralis ppol mac hr oct", "heidelberg_spectralis", "Macula", [(61, 496, 768), (61, 496, 1536)], RASTER,
       aliases=["spectralis ppol mac hr oct small", "spectralis ppol mac hr", "spec mac hr oct"]),
    # release 3; Heidelberg's own export, renamed and given this Protocol Name, not re-encoded
    _p("spectralis mac 20x20 hs octa", "heidelberg_spectralis", "Macula, 20 x 20", [(512, 496, 512)], RASTER,
       aliases=["spec mac 20x20 hs 512 lines octa"], reversed_=True),
    _p("maestro2 3d wide oct", "topcon_maestro2", "Wide Field", [(128, 885, 512)], RASTER, (9.0, 12.0),
       aliases=["maestro2 3d wide"]),
    _p("maestro2 3d macula oct", "topcon_maestro2", "Macula", [(128, 885, 512)], RASTER, (6.0, 6.0),
       aliases=["maestro2 3d macula"]),
    # the documentation's table says 60 frames; its OCTA page and the converter's own check say 360
    _p("maestro2 macula 6x6 octa", "topcon_maestro2", "Macula, 6 x 6", [(360, 885, 360), (60, 885, 360)], RASTER,
       (6.0, 6.0), aliases=["maestro2 mac 6x6 octa", "maestro2 macula 6x6 oct", "maestro2 macula 6x6"]),
    # "3D(H)+Radial 12x9": the 12 x 9 mm raster of the acquisition (a 12-line radial part, where a file holds
    # one, is told apart by its frames' traces)
    _p("triton 3d radial oct", "topcon_triton", "Optic Disc", [(256, 992, 512)], RASTER, (9.0, 12.0),
       aliases=["triton 3d(h)+radial 12x9 oct", "triton 3d(h)+radial 12x9", "triton 3d radial"]),
    _p("triton macula 6x6 octa", "topcon_triton", "Macula, 6 x 6", [(320, 992, 320)], RASTER, (6.0, 6.0),
       aliases=["triton macula 6x6"]),
    _p("triton macula 12x12 octa", "topcon_triton", "Macula, 12 x 12", [(512, 992, 512)], RASTER, (12.0, 12.0),
       aliases=["triton macula 12x12"]),
    # Zeiss's Protocol Names (kept in the headers) as AI-READI's organizer reads them: "<MAC|ONH>-<protocol>"
    _p("cirrus mac oct", "zeiss_cirrus", "Macula", [(128, 1024, 512)], RASTER, (6.0, 6.0),
       header=["Macular Cube 512x128", "MAC-Macular Cube 512x128"],
       aliases=["cirrus mac cube 512x128 oct", "cirrus mac cube 512x128", "cirrus macular cube 512x128 oct",
                "cirrus mac"]),
    _p("cirrus disc oct", "zeiss_cirrus", "Optic Disc", [(200, 1024, 200)], RASTER, (6.0, 6.0),
       header=["Optic Disc Cube 200x200", "ONH-Optic Disc Cube 200x200"],
       aliases=["cirrus disc cube 200x200 oct", "cirrus disc cube 200x200", "cirrus optic disc cube 200x200 oct",
                "cirrus disc"]),
    _p("cirrus macula 6x6 octa", "zeiss_cirrus", "Macula, 6 x 6", [(350, 1024, 350)], RASTER, (6.0, 6.0),
       header=["MAC-Angiography 6x6 mm"], aliases=["cirrus macula 6x6"]),
    _p("cirrus disc 6x6 octa", "zeiss_cirrus", "Optic Disc, 6 x 6", [(350, 1024, 350)], RASTER, (6.0, 6.0),
       header=["ONH-Angiography 6x6 mm"], aliases=["cirrus disc 6x6"]),
)}

# The submodalities AI-READI's converters append to a protocol's id (the acquisition's other files);
# only `oct` is a structural cube. Longest first, so `enface_structural` is not read as `..._enface`.
OTHER_SUBMODALITIES = ("enface_projection_removed", "flow_cube_raw_data", "enface_structural", "short_wavelength",
                       "long_wavelength", "segmentation", "flow_cube", "heightmap", "enface", "ir", "cfp", "faf", "flio")


def normalise(text: str | None) -> str | None:
    """Lower case, underscores and hyphens as spaces, one space between words."""
    if text is None:
        return None
    return " ".join(str(text).replace("_", " ").replace("-", " ").lower().split()) or None


_BY_SPELLING: dict[str, str] = {}
for _proto in PROTOCOLS.values():
    for _s in (_proto.name, _proto.file_id, *_proto.header_names, *_proto.aliases):
        _BY_SPELLING[normalise(_s)] = _proto.name


def lookup(text: str | None) -> str | None:
    """The protocol a Protocol Name or a file name's id spells, in any of its known spellings, with
    the submodality "oct" appended or not; None when it spells none."""
    s = normalise(text)
    while s:
        if s in _BY_SPELLING:
            return _BY_SPELLING[s]
        if not s.endswith(" oct"):
            return None
        s = s[:-4]
    return None


def canonical(text: str | None) -> str | None:
    """`lookup`'s protocol, else the text normalised (an unknown name is kept, not dropped)."""
    return lookup(text) or normalise(text)


@dataclasses.dataclass(frozen=True)
class FileName:
    participant: str
    body: str              # between the participant and the laterality: <id>_<submodality>
    submodality: str | None  # oct (a structural cube), another of OTHER_SUBMODALITIES, or None: not told
    protocol: str | None   # the table's protocol the id names, else None
    laterality: str


# <participant>_<body>_<l|r>_<SOP Instance UID>.dcm
_FILE_NAME = re.compile(r"^(?P<pid>[^_]+)_(?P<body>.+)_(?P<lat>[lr])_(?P<uid>\d[\d.]*)\.dcm$", re.I)


def parse_file_name(name: str) -> FileName | None:
    """A release file name's parts, or None when the name is not in the release's form."""
    m = _FILE_NAME.match(name)
    if not m:
        return None
    body = m.group("body").lower()
    sub = STRUCTURAL if body.endswith("_" + STRUCTURAL) else next(
        (s for s in OTHER_SUBMODALITIES if body.endswith("_" + s)), None)
    protocol = lookup(body) if sub in (STRUCTURAL, None) else None
    return FileName(m.group("pid"), body, sub, protocol, m.group("lat").lower())


def from_file_name(name: str) -> str | None:
    """The protocol of a release file name's structural cube (`1001_cirrus_mac_oct_oct_l_<uid>.dcm` ->
    "cirrus mac oct"), or None."""
    parsed = parse_file_name(name)
    return parsed.protocol if parsed else None


def other_modality(name: str) -> str | None:
    """The submodality a release file name gives when it is not a structural cube (flow_cube,
    enface, ir, ...), else None."""
    parsed = parse_file_name(name)
    return parsed.submodality if parsed and parsed.submodality not in (STRUCTURAL, None) else None


def known(protocol: str | None) -> Protocol | None:
    return PROTOCOLS.get(protocol or "")


def published_pattern(protocol: str | None) -> str | None:
    """The scan pattern the documentation gives for this protocol, else None."""
    p = known(protocol)
    return p.pattern if p else None


def published_field(protocol: str | None) -> list[float | None] | None:
    """[across frames, depth, along columns] in mm as published (depth never is), else None."""
    p = known(protocol)
    if p is None or p.field_mm == (None, None):
        return None
    return [p.field_mm[0], None, p.field_mm[1]]


def by_shape(shape, device: str | None = None, region: str | None = None) -> list[Protocol]:
    """The protocols whose published shape is `shape` (frames, rows, columns), narrowed to the
    scanner when it is known, and to the region word where that narrows them; as AI-READI's own
    classifier tells its protocols apart (docs/data.md, "Scan protocols")."""
    hits = [p for p in PROTOCOLS.values() if tuple(shape) in p.shapes and (device is None or p.device == device)]
    in_region = [p for p in hits if region and region_word(p.region) == region]
    return in_region or hits


AXES = ("across frames", "in depth", "along B-scans")   # a volume's axes 0, 1, 2 (frames, rows, columns), in words
GEOMETRY_TOLERANCE = 0.1   # relative disagreement between two witnesses of one extent that is reported


def disagreement(axis: str, said: dict[str, float | None], detail: dict[str, str] | None = None) -> str | None:
    """`<axis>: <witness> <value> mm, ...` when two of the witnesses' extents (mm) differ by more than
    GEOMETRY_TOLERANCE, else None. `detail`: a note after a witness's value (how it was computed)."""
    known = {w: v for w, v in said.items() if v is not None}
    if not any(abs(a - b) > GEOMETRY_TOLERANCE * max(a, b) for a in known.values() for b in known.values()):
        return None
    return f"{axis}: " + ", ".join(f"{w} {v:.3g} mm{(detail or {}).get(w, '')}" for w, v in known.items())


def region_word(anatomic_region: str | None) -> str | None:
    """manifest.tsv's anatomic_region without its field ("Macula, 6 x 6" -> "macula"), for `select`."""
    if not anatomic_region:
        return None
    return normalise(anatomic_region.split(",")[0])


REGIONS = tuple(sorted({region_word(p.region) for p in PROTOCOLS.values()}))


def nearest(value: str, choices) -> list[str]:
    """Up to three known values closest to an unknown one, for error messages."""
    return difflib.get_close_matches(value, list(choices), n=3, cutoff=0.4)

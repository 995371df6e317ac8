"""AI-READI's structural OCT scan protocols: what each one is (device, region, pattern, field),
and how a file says which it is (its Protocol Name (0018,1030), and its file name).

The twelve protocols and their shapes are those the AI-READI documentation lists (retinal OCT
page; docs/data.md, "Scan protocols"). Only raster protocols sample a volume: a radial scan's
B-scans cross at the disc centre, so resampling across them as neighbouring slices makes a
meaningless cube; `make cache` skips them by default (configs/cache.yaml `select`).
"""
from __future__ import annotations

import dataclasses
import re

RASTER, RADIAL, LINE = "raster", "radial", "line"
PATTERNS = (RASTER, RADIAL, LINE)
UNKNOWN = "unknown"   # what configs/cache.yaml `select` calls a scan whose pattern nothing tells


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str                                   # normalised Protocol Name, as the documentation lists it
    device: str
    region: str                                 # manifest.tsv's anatomic_region as AI-READI writes it
    shapes: tuple[tuple[int, int, int], ...]    # published frames x rows x columns
    pattern: str
    field_mm: tuple[float | None, float | None]  # published extent across frames, along columns (None: not published)
    aliases: tuple[str, ...] = ()               # other spellings: AI-READI's header values and file-name ids

    @property
    def header_name(self) -> str:
        """The Protocol Name AI-READI writes into the header (its first alias where it renamed it)."""
        return self.aliases[0] if self.aliases else self.name

    @property
    def file_id(self) -> str:
        """The protocol as a release file name spells it: the header name in snake case, "oct" appended
        (as the release's Spectralis names show: ..._ppol_mac_hr_oct_oct_l_<uid>.dcm)."""
        return "_".join(self.header_name.split()) + "_oct"


def _p(name, device, region, shapes, pattern, field=(None, None), aliases=()) -> Protocol:
    return Protocol(name, device, region, tuple(shapes), pattern, field, tuple(aliases))


# The field of a "12x9" scan: 12 mm along the B-scan (columns), 9 mm across B-scans (frames). Regions and
# aliases as AI-READI's own conversion code writes them (AI-READI/aireadi_retinal_imaging, year_3/imaging_utils.py
# protocol_mapping and the Topcon metadata's region mapping); Cirrus keeps Zeiss's own Protocol Name there, which
# no public file shows, so its rows are known by file name.
PROTOCOLS = {p.name: p for p in (
    _p("spectralis onh rc hr oct", "heidelberg_spectralis", "Optic Disc", [(27, 496, 768)], RADIAL),
    _p("spectralis ppol mac hr oct", "heidelberg_spectralis", "Macula", [(61, 496, 768), (61, 496, 1536)], RASTER,
       aliases=["spectralis ppol mac hr oct", "spectralis ppol mac hr oct small"]),
    _p("maestro2 3d wide oct", "topcon_maestro2", "Wide Field", [(128, 885, 512)], RASTER, (9.0, 12.0)),
    _p("maestro2 3d macula oct", "topcon_maestro2", "Macula", [(128, 885, 512)], RASTER, (6.0, 6.0)),
    _p("maestro2 mac 6x6 octa", "topcon_maestro2", "Macula, 6 x 6", [(60, 885, 360)], RASTER, (6.0, 6.0),
       aliases=["maestro2 macula 6x6 octa", "maestro2 macula 6x6 oct", "maestro2 macula 6x6"]),
    _p("triton 3d(h)+radial 12x9 oct", "topcon_triton", "Optic Disc", [(256, 992, 512)], RASTER, (9.0, 12.0),
       aliases=["triton 3d radial oct", "triton 3d(h)+radial 12x9"]),
    _p("triton macula 6x6 octa", "topcon_triton", "Macula, 6 x 6", [(320, 992, 320)], RASTER, (6.0, 6.0)),
    _p("triton macula 12x12 octa", "topcon_triton", "Macula, 12 x 12", [(512, 992, 512)], RASTER, (12.0, 12.0)),
    _p("cirrus mac cube 512x128 oct", "zeiss_cirrus", "Macula", [(128, 1024, 512)], RASTER, (6.0, 6.0)),
    _p("cirrus disc cube 200x200 oct", "zeiss_cirrus", "Optic Disc", [(200, 1024, 200)], RASTER, (6.0, 6.0)),
    _p("cirrus macula 6x6 octa", "zeiss_cirrus", "Macula, 6 x 6", [(350, 1024, 350)], RASTER, (6.0, 6.0)),
    _p("cirrus disc 6x6 octa", "zeiss_cirrus", "Optic Disc, 6 x 6", [(350, 1024, 350)], RASTER, (6.0, 6.0)),
)}
_ALIASES = {alias: p.name for p in PROTOCOLS.values() for alias in p.aliases}

# <participant>_<protocol id>_<l|r>_<SOP Instance UID>.dcm: the release's file names (AI-READI's conversion code
# writes the id in snake case, some releases with the submodality "oct" appended: ..._hr_oct_oct_l_<uid>.dcm)
_FILE_NAME = re.compile(r"^(?P<pid>[^_]+)_(?P<protocol>.+)_(?P<lat>[lr])_(?P<uid>\d[\d.]*)\.dcm$", re.I)


def normalise(text: str | None) -> str | None:
    """A Protocol Name as the table spells it: lower case, underscores as spaces, one space between
    words, a doubled trailing "oct" once, and a known alias as its protocol's name. Unknown names
    come back normalised, not dropped."""
    if text is None:
        return None
    s = " ".join(str(text).replace("_", " ").lower().split())
    while s.endswith(" oct oct") or s.endswith(" octa oct"):
        s = s[:-4]
    return _ALIASES.get(s, s) or None


def from_file_name(name: str) -> str | None:
    """The protocol a release file name carries (`1001_maestro2_3d_wide_oct_l_<uid>.dcm` ->
    "maestro2 3d wide oct"), or None when the name is not in the release's form."""
    m = _FILE_NAME.match(name)
    return normalise(m.group("protocol")) if m else None


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


def region_word(anatomic_region: str | None) -> str | None:
    """manifest.tsv's anatomic_region without its field ("Macula, 6 x 6" -> "macula"), for `select`."""
    if not anatomic_region:
        return None
    return " ".join(anatomic_region.split(",")[0].lower().split()) or None

"""The retinal phantom: a retina-like uint8 OCT volume [frames, rows, cols] drawn from a few random numbers.

Layered retina with a foveal pit, an optic-disc-side thickening and a vessel shadow (an up-down
marker), multiplicative speckle and log compression; and the learning-check cohorts' class cues:
macular lesions (`sample_eye`, `lesion_table`) and a thicker inner nuclear layer. ingest/synth.py
writes these volumes as DICOM in an AI-READI-shaped tree.
"""
from __future__ import annotations

import dataclasses

import numpy as np

# Layer stack from the vitreous down: (name, thickness as a fraction of the depth, brightness).
LAYERS = (
    ("rnfl", 0.030, 0.80), ("gcl_ipl", 0.055, 0.55), ("inl", 0.030, 0.28), ("opl", 0.020, 0.55),
    ("onl", 0.060, 0.22), ("ez", 0.010, 0.75), ("rpe", 0.016, 0.95), ("choroid", 0.120, 0.50),
)
VITREOUS, SCLERA = 0.04, 0.15
LAYER_INDEX = {name: i for i, (name, _, _) in enumerate(LAYERS)}

# The learning-check cohorts' class cues (SynthConfig.lesions, SynthConfig.layers).
# Lesions: local, in the macula, as a researcher would look for them in diabetic retinopathy.
# Hyperreflective foci (small bright dots in the inner retina) and intraretinal fluid cysts (dark
# pockets in the INL/OPL) whose expected number per eye grows with the study-group label (0
# healthy ... 3 insulin dependent). Healthy eyes have some too, and counts are Poisson, so single
# eyes overlap between classes (a subtle cue, not a give-away). Rendered as OCT renders them: a
# lesion scales the reflectivity of the tissue it sits in by a contrast drawn per lesion (so a
# focus in a dark layer stays darker than one in a bright layer), with a Gaussian partial-volume
# edge rather than a plateau, before the speckle multiplies lesion and tissue alike; each
# lesion's size is drawn from a range.
FOCI_PER_EYE = (1.5, 2.5, 3.5, 4.5)
CYSTS_PER_EYE = (0.3, 0.6, 0.9, 1.2)
FOCUS_RADII = (0.12, 0.06, 0.018)     # frames (y), columns (x), depth (z): fractions of the [-1,1] / [0,1] axes
CYST_RADII = (0.18, 0.09, 0.02)
FOCUS_CONTRAST = (0.8, 1.6)           # relative change of the layer's reflectivity at a focus centre
CYST_CONTRAST = (-0.9, -0.6)          # ... and at a cyst centre (fluid is dark)
LESION_SIZE = (0.6, 1.6)              # each lesion's radii x a factor drawn log-uniformly from this range
LESION_EDGE = 4.0                     # the profile exp(-1.5 d^2) is cut at d^2 = 4 (2 radii; < 0.3% left)
# Layers: the inner nuclear layer thickens by `layers` x label (relative, at the peak) over a
# Gaussian patch of the macula (radius 0.35-0.6 of the half-width: many B-scans and columns),
# placed at random per eye; the outer nuclear layer below thins by as much, so the retina's total
# thickness, and with it the global statistics, carry nothing of the label. A masked block of
# the patch can be predicted from the visible rest of it: the cue V-JEPA's latent term should learn.
BUMP_RADIUS = (0.35, 0.6)
LESION_COLUMNS = ("kind", "layer", "y", "x", "z", "radius_y", "radius_x", "radius_z", "contrast")


@dataclasses.dataclass(frozen=True)
class Lesion:
    y: float                  # frame coordinate in [-1, 1]
    x: float                  # column coordinate in [-1, 1]
    layer: str                # centred in this layer's depth at (y, x)
    radii: tuple[float, float, float]
    contrast: float           # relative change of the surrounding reflectivity at the centre


@dataclasses.dataclass(frozen=True)
class Eye:
    """Per-eye anatomy beyond the defaults: lesions, and confounders drawn independently of the label."""
    lesions: tuple[Lesion, ...] = ()
    thickness: float = 1.0    # every layer's thickness scaled by this
    offset: float = 0.0       # added to the reflectivity before speckle (global brightness)
    inl_bump: tuple[float, float, float, float] | None = None  # (y, x, radius, relative INL thickening at the peak)


def _macula_point(rng: np.random.Generator) -> tuple[float, float]:
    """A point in the macula (inside the probes' centre crop) off the foveal pit, where the
    inner layers are thin."""
    while True:
        y, x = rng.uniform(-0.6, 0.6), rng.uniform(-0.55, 0.55)
        if x ** 2 + y ** 2 > 0.06:
            return float(y), float(x)


def _scaled(radii: tuple[float, float, float], size: float) -> tuple[float, float, float]:
    return tuple(r * size for r in radii)


def _lesion(rng: np.random.Generator, layers: list[str], radii, contrast: tuple[float, float], size: float) -> Lesion:
    y, x = _macula_point(rng)
    layer = str(rng.choice(layers))
    factor = size * float(np.exp(rng.uniform(*np.log(LESION_SIZE))))
    return Lesion(y, x, layer, _scaled(radii, factor), float(rng.uniform(*contrast)))


def sample_eye(label: int | None, rng: np.random.Generator, lesions: float = 1.0, size: float = 1.0,
               layers: float = 0.0) -> Eye:
    """An eye of the cohort: lesion counts from the label (`lesions` scales the rates' growth
    with the label; 0: every class like healthy; `size` scales every lesion's radii), a patch
    of thicker inner nuclear layer growing with the label when `layers` > 0, and thickness and
    brightness independent of it."""
    lab = 0 if label is None else int(label)
    rate = lambda table: table[0] + lesions * (table[lab] - table[0])  # noqa: E731
    items = [_lesion(rng, ["gcl_ipl", "inl", "opl"], FOCUS_RADII, FOCUS_CONTRAST, size)
             for _ in range(rng.poisson(rate(FOCI_PER_EYE)))]
    items += [_lesion(rng, ["inl", "opl"], CYST_RADII, CYST_CONTRAST, size)
              for _ in range(rng.poisson(rate(CYSTS_PER_EYE)))]
    eye = Eye(tuple(items), thickness=float(rng.uniform(0.85, 1.15)), offset=float(rng.uniform(-0.04, 0.04)))
    if layers:
        y, x = _macula_point(rng)
        eye = dataclasses.replace(eye, inl_bump=(y, x, float(rng.uniform(*BUMP_RADIUS)), layers * lab))
    return eye


def _paint_lesions(img: np.ndarray, lesions, yf: float, x: np.ndarray, z: np.ndarray, bounds_f: np.ndarray) -> np.ndarray:
    """Scale the reflectivity image [R, C] by each lesion crossing frame coordinate `yf`: by
    1 + contrast at its centre, with a Gaussian partial-volume profile around it. Only the
    columns a lesion can reach are computed (elsewhere its factor is exactly 1)."""
    for les in lesions:
        ry, rx, rz = les.radii
        dy = ((yf - les.y) / ry) ** 2
        if dy >= LESION_EDGE:
            continue
        dx = ((x[0] - les.x) / rx) ** 2                                              # [C]
        cols = np.flatnonzero(dx < LESION_EDGE)   # d2 = dy + dx + dz >= dx: outside these, no change
        if not cols.size:
            continue
        lo, hi = cols[0], cols[-1] + 1
        k = LAYER_INDEX[les.layer]
        zc = (bounds_f[lo:hi, k] + bounds_f[lo:hi, k + 1]) / 2                        # layer middle
        d2 = dy + dx[None, lo:hi] + ((z[:, None] - zc[None, :]) / rz) ** 2
        w = np.where(d2 < LESION_EDGE, np.exp(-1.5 * d2), 0.0)
        img[:, lo:hi] = img[:, lo:hi] * (1.0 + les.contrast * w)
    return img


@dataclasses.dataclass
class VolumeDraws:
    """The random numbers a volume needs from the cohort's one sequential stream: a few scalars
    and the seed of the volume's own noise stream. The speckle and noise floor (most of the
    random numbers) are drawn from that seed where the volume is rendered, so a pool of
    processes draws them in parallel and nothing large crosses a process boundary."""
    tilt: float
    lift: float
    gain: float
    noise: int   # seeds the volume's speckle and noise floor (render_volume)


def draw_volume(shape: tuple[int, int, int], rng: np.random.Generator) -> VolumeDraws:
    tilt, lift, gain = rng.uniform(-0.04, 0.04), rng.uniform(-0.03, 0.03), rng.uniform(0.85, 1.15)
    return VolumeDraws(tilt, lift, gain, int(rng.integers(2 ** 63)))


def frame_noise(rng: np.random.Generator, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One frame's multiplicative speckle and additive noise floor (speckle first: the stream's order)."""
    speckle = rng.gamma(2.0, 0.5, size=size).astype(np.float32)
    return speckle, np.abs(rng.normal(0.03, 0.02, size=size)).astype(np.float32)


def make_volume(shape: tuple[int, int, int], rng: np.random.Generator, laterality: str = "R",
                label: int | None = None, signal: float = 0.0, eye: Eye | None = None) -> np.ndarray:
    """A retina-like uint8 volume [frames, rows, cols] (`render_volume` of `draw_volume`)."""
    return render_volume(shape, draw_volume(shape, rng), laterality, label, signal, eye)


def layer_bounds(y: np.ndarray, x: np.ndarray, tilt: float, lift: float, laterality: str = "R",
                 label: int | None = None, signal: float = 0.0, eye: Eye | None = None) -> np.ndarray:
    """Depth (fraction of the rows, 0 at the top) of every layer boundary at frame coordinates `y`
    and column coordinates `x` (both in [-1, 1], broadcast): [..., len(LAYERS) + 1], the retinal
    surface first. One formula for rendering and for the lesion table's depths."""
    eye = eye or Eye()
    disc_x = 0.85 if laterality == "R" else -0.85
    r2 = x ** 2 + y ** 2
    fovea = np.exp(-r2 / 0.03)
    surface = 0.36 - 0.08 * x ** 2 - 0.03 * y ** 2 + tilt * x + 0.035 * fovea + lift
    thick, moved = [], 0.0
    for name, t, _ in LAYERS:
        t = np.full_like(surface, t)
        if name == "rnfl":
            t = t * (0.4 + 2.0 * np.exp(-((x - disc_x) ** 2 + y ** 2) / 0.15)) * (1 - 0.8 * fovea)
        elif name in ("gcl_ipl", "inl", "opl"):
            t = t * (1 - 0.85 * fovea)
        if name == "inl" and signal and label is not None:
            t = t + signal * 0.012 * label
        if name == "inl" and eye.inl_bump is not None:   # the layers cue: thicker INL, thinner ONL, same total
            by, bx, br, amp = eye.inl_bump
            moved = t * amp * np.exp(-((x - bx) ** 2 + (y - by) ** 2) / (2 * br ** 2))
            t = t + moved
        elif name == "onl":
            t = t - moved
        thick.append(t * eye.thickness)
    bounds = surface[..., None] + np.cumsum(np.stack(thick, -1), -1)
    return np.concatenate([surface[..., None], bounds], -1)


def lesion_table(draws: VolumeDraws, laterality: str, label: int | None, signal: float, eye: Eye | None) -> list[dict]:
    """Where each lesion of an eye sits, in the rendered (upright) volume's coordinates: frame `y`
    and column `x` in [-1, 1] (linspace over the axis), depth `z` in [0, 1] (row centres at
    (i + 0.5) / rows), the radii on those axes and the kind. The token-level probe reads it
    (check/token_probe.py); a cache resized over the whole extent keeps these fractions."""
    out = []
    for les in (eye.lesions if eye else ()):
        b = layer_bounds(np.float32(les.y), np.float32(les.x), draws.tilt, draws.lift, laterality, label, signal, eye)
        k = LAYER_INDEX[les.layer]
        out.append({"kind": "focus" if les.contrast > 0 else "cyst", "layer": les.layer, "y": les.y, "x": les.x,
                    "z": float((b[k] + b[k + 1]) / 2), "radius_y": les.radii[0], "radius_x": les.radii[1],
                    "radius_z": les.radii[2], "contrast": les.contrast})
    return out


def render_volume(shape: tuple[int, int, int], draws: VolumeDraws, laterality: str = "R",
                  label: int | None = None, signal: float = 0.0, eye: Eye | None = None) -> np.ndarray:
    """A retina-like uint8 volume [frames, rows, cols] from its random draws.

    `signal` > 0 plants a class cue: the inner nuclear layer thickens with the label, which a
    probe can learn (issue: probes on planted signal).
    A vessel arches from the disc towards frame 0 only and shadows the tissue below it: an
    up-down marker, so a frame-reversed cube shows its arc at the bottom of an en-face image.
    `eye` adds lesions and per-eye thickness and brightness (the learning-check cohort).
    """
    eye = eye or Eye()
    frames, rows, cols = shape
    y = np.linspace(-1, 1, frames, dtype=np.float32)[:, None]
    x = np.linspace(-1, 1, cols, dtype=np.float32)[None, :]
    disc_x = 0.85 if laterality == "R" else -0.85
    bounds = layer_bounds(y, x, draws.tilt, draws.lift, laterality, label, signal, eye)  # [F, C, L+1]
    levels = np.array([VITREOUS] + [b for _, _, b in LAYERS] + [SCLERA], dtype=np.float32)
    z = (np.arange(rows, dtype=np.float32) + 0.5) / rows
    arc = -0.7 * np.sqrt(np.clip(np.abs(x - disc_x) / 1.7, 0, 1))                # vessel centre line (frames)
    half_width = max(0.06, 1.0 / max(frames - 1, 1))                            # at least one frame per column
    vessel = (np.abs(y - arc) < half_width) & (np.abs(x - disc_x) < 1.7)       # [F, C]
    out = np.empty(shape, dtype=np.uint8)
    noise = np.random.default_rng(draws.noise)
    for f in range(frames):
        speckle, floor = frame_noise(noise, (rows, cols))
        idx = np.zeros((rows, cols), dtype=np.intp)                            # [R, C] layer index:
        for k in range(bounds.shape[-1]):                                      # boundaries above each voxel
            idx += z[:, None] > bounds[f, :, k][None]
        img = levels[idx]
        depth_below = np.clip(z[:, None] - bounds[f, :, -2][None], 0, None)     # choroid fades
        img = img * np.where(idx >= len(LAYERS), np.exp(-depth_below * 8), 1.0)
        img = img * np.where(vessel[f][None, :] & (idx > 1), 0.5, 1.0)          # shadow below the RNFL
        img = _paint_lesions(img, eye.lesions, float(y[f, 0]), x, z, bounds[f]) + eye.offset
        img = draws.gain * img * speckle + floor                               # speckle, noise floor
        img = np.log1p(40 * np.clip(img, 0, None)) / np.log1p(40 * 1.6)
        out[f] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return out

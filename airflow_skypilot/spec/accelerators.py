"""Accelerator names: SkyPilot's canonical spelling, GPU memory, and matching backend labels.

SkyPilot canonicalises ``a100`` to ``A100`` from its catalog; we ship the common names so this
works offline. A name we do not know is kept as written (SkyPilot does the same, for custom
accelerators on Kubernetes). Backends report GPUs in their own words (Slurm GRES ``a100``,
node label ``NVIDIA-A100-SXM4-80GB``, EC2 GpuInfo ``A10G``); :func:`canonical_from_label`
turns those into the same canonical names so a request and an offer can be compared.
"""

from __future__ import annotations

import re

#: canonical name -> (manufacturer, memory in GB). Source: SkyPilot's catalog
#: common/metadata.csv and vendor data sheets, 2026.
GPUS: dict[str, tuple[str, float]] = {
    "B200": ("NVIDIA", 180),
    "B300": ("NVIDIA", 288),
    "GB200": ("NVIDIA", 186),
    "H200": ("NVIDIA", 141),
    "H100": ("NVIDIA", 80),
    "H100-MEGA": ("NVIDIA", 80),
    "GH200": ("NVIDIA", 96),
    "A100-80GB": ("NVIDIA", 80),
    "A100": ("NVIDIA", 40),
    "L40S": ("NVIDIA", 48),
    "L40": ("NVIDIA", 48),
    "L4": ("NVIDIA", 24),
    "A40": ("NVIDIA", 48),
    "A30": ("NVIDIA", 24),
    "A10G": ("NVIDIA", 24),
    "A10": ("NVIDIA", 24),
    "RTXA6000": ("NVIDIA", 48),
    "RTX6000-Ada": ("NVIDIA", 48),
    "A6000": ("NVIDIA", 48),
    "A5000": ("NVIDIA", 24),
    "A4000": ("NVIDIA", 16),
    "RTX4090": ("NVIDIA", 24),
    "RTX3090": ("NVIDIA", 24),
    "V100-32GB": ("NVIDIA", 32),
    "V100": ("NVIDIA", 16),
    "T4": ("NVIDIA", 16),
    "T4g": ("NVIDIA", 16),
    "P100": ("NVIDIA", 16),
    "P4": ("NVIDIA", 8),
    "K80": ("NVIDIA", 12),
    "M60": ("NVIDIA", 8),
    "MI300X": ("AMD", 192),
    "MI325X": ("AMD", 256),
    "MI250X": ("AMD", 128),
    "Gaudi2": ("Intel", 96),
    "Gaudi3": ("Intel", 128),
    "Inferentia2": ("AWS", 32),
    "Trainium": ("AWS", 32),
    "Trainium2": ("AWS", 96),
}

#: SkyPilot's canonical accelerator names (catalog v8, common/accelerators.csv), which is what
#: it canonicalises against, offline. ``tpu-*`` names are separate (always lower-case).
CATALOG_NAMES = (
    "A10", "A100", "A100-80GB", "A100-80GB-SXM", "A10G", "A30", "A40", "A4000", "A6000", "A800",
    "B200", "GH200", "GTX1660S", "Gaudi HL-205", "H100", "H100-MEGA", "H100-NVL", "H100-NVLINK",
    "H100-SXM", "H200", "H200-SXM", "K80", "L4", "L40", "L40S", "M4000", "M60", "MI300X", "P100",
    "P4", "P4000", "RTX3060", "RTX3070", "RTX3080", "RTX3090", "RTX4000-Ada", "RTX4090",
    "RTX5060", "RTX5090", "RTX6000", "RTX6000-Ada", "RTX6000Ada", "RTXA4000", "RTXA4500",
    "RTXA5000", "RTXA6000", "RTXPRO6000S", "RTXPRO6000WS", "Radeon MI25", "Radeon Pro V520",
    "T4", "T4g", "V100", "V100-32GB",
)
_CATALOG_LOWER = {name.lower(): name for name in CATALOG_NAMES}
_BY_LOWER = {name.lower(): name for name in (*GPUS, *CATALOG_NAMES)}
# Longest names first, so "A100-80GB" is tried before "A100" and "L40S" before "L40".
_MATCH_ORDER = sorted(GPUS, key=len, reverse=True)
_MEMORY_RE = re.compile(r"^([0-9]+)([GgMmTt][Bb])(\+?)$")


class AmbiguousAcceleratorError(ValueError):
    """A partial name matches several catalog names (SkyPilot refuses these too)."""


def canonical(name: str) -> str:
    """SkyPilot's spelling of an accelerator name (sky/utils/accelerator_registry.py).

    ``tpu-*`` lower-case; an exact case-insensitive catalog match wins; else a unique
    case-insensitive substring (regex) match (``MI300`` -> ``MI300X``); several matches are an
    error; no match keeps the name as written (a custom accelerator, e.g. on Kubernetes).
    """
    if name.lower().startswith("tpu-"):
        return name.lower()
    if name.lower() in _CATALOG_LOWER:
        return _CATALOG_LOWER[name.lower()]
    try:
        pattern = re.compile(name, re.IGNORECASE)
    except re.error:
        pattern = re.compile(re.escape(name), re.IGNORECASE)
    matches = [n for n in CATALOG_NAMES if pattern.search(n)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise AmbiguousAcceleratorError(
            f"accelerator name {name!r} is ambiguous; choose one of {matches}")
    return name


def is_known(name: str) -> bool:
    return name.lower() in _BY_LOWER or name.lower().startswith("tpu-")


def memory_spec(text: str) -> tuple[float, bool] | None:
    """``80GB+`` -> (80.0, True); ``None`` when ``text`` is not a memory size."""
    match = _MEMORY_RE.match(text)
    if not match:
        return None
    value = float(match.group(1))
    unit = match.group(2).lower()
    value *= {"mb": 1 / 1024, "gb": 1, "tb": 1024}[unit]
    return value, bool(match.group(3))


def devices_by_memory(memory_gb: float, at_least: bool, manufacturer: str | None) -> list[str]:
    """GPUs with exactly (or at least) that much memory, as SkyPilot's ``80GB+:8`` form means."""
    out = []
    for name, (maker, mem) in GPUS.items():
        if manufacturer and maker.lower() != manufacturer.lower():
            continue
        if (mem >= memory_gb) if at_least else (mem == memory_gb):
            out.append(name)
    return out


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def canonical_from_label(value: str) -> str:
    """Canonical name for a backend's own GPU label (GRES type, node label, EC2 GpuInfo name).

    ``a100`` -> A100, ``NVIDIA-A100-SXM4-80GB`` -> A100-80GB, ``nvidia-tesla-t4`` -> T4,
    ``nvidia-h100-80gb`` -> H100, ``NVIDIA-L40S`` -> L40S. Unknown labels come back unchanged.
    """
    if not value:
        return value
    if value.lower() in _BY_LOWER:
        return _BY_LOWER[value.lower()]
    squashed = _squash(value)
    for prefix in ("nvidia", "tesla", "amd", "instinct", "geforce", "intel", "habana"):
        if squashed.startswith(prefix):
            squashed = squashed[len(prefix):]
    for prefix in ("tesla", "geforce", "instinct"):
        if squashed.startswith(prefix):
            squashed = squashed[len(prefix):]
    for name in _MATCH_ORDER:
        key = _squash(name)
        if not squashed.startswith(key):
            continue
        rest = squashed[len(key):]
        # "A100" followed by a memory suffix that names the 80GB part.
        if name == "A100" and "80gb" in rest:
            return "A100-80GB"
        if name == "V100" and "32gb" in rest:
            return "V100-32GB"
        # "A10" must not swallow "A100"; "L4" must not swallow "L40".
        if rest[:1].isdigit():
            continue
        return name
    return value


def same_accelerator(requested: str, offered_label: str) -> bool:
    """Does a backend GPU label satisfy a requested (canonical or custom) accelerator name?"""
    want = canonical(requested)
    have = canonical_from_label(offered_label)
    return want.lower() == have.lower() or _squash(want) == _squash(offered_label)

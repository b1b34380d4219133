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

#: SkyPilot's canonical accelerator names and the clouds that offer each (catalog v8,
#: common/accelerators.csv, as embedded in tests/conformance/generate_verdicts.py), which is
#: what it canonicalises against, offline. ``tpu-*`` names are separate (always lower-case).
#: The clouds are spelled as in that file (SkyPilot compares them case-sensitively with its
#: clouds' names, so its 'Nebius' never matches the file's 'nebius').
CATALOG: dict[str, tuple[str, ...]] = {
    "A10": ("Azure", "Lambda", "OCI"),
    "A100": ("AWS", "Azure", "Cudo", "GCP", "Lambda", "OCI", "PrimeIntellect", "Seeweb",
             "Vast"),
    "A100-80GB": ("AWS", "Azure", "GCP", "Lambda", "OCI", "Paperspace", "PrimeIntellect",
                  "RunPod", "scp"),
    "A100-80GB-SXM": ("RunPod",),
    "A10G": ("AWS",),
    "A30": ("Seeweb",),
    "A40": ("Cudo", "RunPod", "Vast"),
    "A4000": ("Paperspace", "PrimeIntellect"),
    "A6000": ("Lambda", "PrimeIntellect"),
    "A800": ("Cudo",),
    "B200": ("AWS", "Lambda", "PrimeIntellect", "RunPod", "nebius"),
    "GH200": ("Lambda",),
    "GTX1660S": ("Vast",),
    "Gaudi HL-205": ("AWS",),
    "H100": ("AWS", "Azure", "DO", "GCP", "Hyperbolic", "Lambda", "OCI", "Paperspace",
             "PrimeIntellect", "RunPod", "Seeweb", "Vast", "nebius"),
    "H100-MEGA": ("GCP",),
    "H100-NVL": ("RunPod",),
    "H100-NVLINK": ("Fluidstack",),
    "H100-SXM": ("Cudo", "RunPod"),
    "H200": ("AWS", "GCP", "OCI", "PrimeIntellect", "Seeweb", "Vast", "nebius"),
    "H200-SXM": ("RunPod",),
    "K80": ("Azure",),
    "L4": ("AWS", "GCP", "RunPod", "Seeweb"),
    "L40": ("PrimeIntellect", "RunPod"),
    "L40S": ("AWS", "Cudo", "OCI", "PrimeIntellect", "RunPod", "Seeweb", "Vast", "nebius"),
    "M4000": ("Paperspace",),
    "M60": ("Azure",),
    "MI300X": ("RunPod",),
    "P100": ("GCP", "OCI"),
    "P4": ("GCP",),
    "P4000": ("Paperspace",),
    "RTX3060": ("Vast",),
    "RTX3070": ("Vast",),
    "RTX3080": ("Vast",),
    "RTX3090": ("RunPod", "Vast"),
    "RTX4000-Ada": ("RunPod",),
    "RTX4090": ("RunPod", "Vast"),
    "RTX5060": ("Vast",),
    "RTX5090": ("Vast",),
    "RTX6000": ("Lambda", "Seeweb"),
    "RTX6000-Ada": ("RunPod", "Vast"),
    "RTX6000Ada": ("PrimeIntellect",),
    "RTXA4000": ("RunPod",),
    "RTXA4500": ("RunPod",),
    "RTXA5000": ("Cudo", "RunPod"),
    "RTXA6000": ("Cudo", "RunPod", "Seeweb", "Vast"),
    "RTXPRO6000S": ("Vast",),
    "RTXPRO6000WS": ("Vast",),
    "Radeon MI25": ("Azure",),
    "Radeon Pro V520": ("AWS",),
    "T4": ("AWS", "Azure", "GCP"),
    "T4g": ("AWS",),
    "V100": ("AWS", "Azure", "Cudo", "GCP", "IBM", "Lambda", "OCI", "Paperspace",
             "PrimeIntellect", "Vast"),
    "V100-32GB": ("AWS", "Azure", "Paperspace", "scp"),
}
CATALOG_NAMES = tuple(CATALOG)

#: our cloud names (the first part of ``infra``) -> SkyPilot's names of its clouds (``str(cloud)``)
SKYPILOT_CLOUD_NAMES = {
    "aws": "AWS", "azure": "Azure", "gcp": "GCP", "ibm": "IBM", "lambda": "Lambda", "scp": "SCP",
    "oci": "OCI", "kubernetes": "Kubernetes", "runpod": "RunPod", "vast": "Vast",
    "vsphere": "vSphere", "cudo": "Cudo", "fluidstack": "Fluidstack",
    "paperspace": "Paperspace", "primeintellect": "PrimeIntellect", "do": "DO",
    "nebius": "Nebius", "ssh": "SSH", "slurm": "Slurm", "hyperbolic": "Hyperbolic",
    "seeweb": "Seeweb", "shadeform": "Shadeform", "yotta": "Yotta", "mithril": "Mithril",
    "verda": "Verda",
}
_CATALOG_LOWER = {name.lower(): name for name in CATALOG_NAMES}
_BY_LOWER = {name.lower(): name for name in (*GPUS, *CATALOG_NAMES)}
# Longest names first, so "A100-80GB" is tried before "A100" and "L40S" before "L40".
_MATCH_ORDER = sorted(GPUS, key=len, reverse=True)
_MEMORY_RE = re.compile(r"^([0-9]+)([GgMmTt][Bb])(\+?)$")


class AmbiguousAcceleratorError(ValueError):
    """A partial name matches several catalog names (SkyPilot refuses these too)."""


def canonical(name: str, cloud: str | None = None) -> str:
    """SkyPilot's spelling of an accelerator name for a candidate on ``cloud`` (our cloud name,
    e.g. ``kubernetes``; None: any cloud), as sky/utils/accelerator_registry.py
    ``canonicalize_accelerator_name`` does offline.

    ``tpu-*`` lower-case; an exact case-insensitive catalog match wins; else the catalog
    names that contain it (case-insensitive regex search) *and that the cloud offers*: one is
    the name (``MI300`` -> ``MI300X`` for any cloud), several are an error; none keeps the name
    as written (a custom accelerator: ``MI300`` stays ``MI300`` on Kubernetes, whose labels
    decide, as no catalog cloud of MI300X is Kubernetes).
    """
    if name.lower().startswith("tpu-"):
        return name.lower()
    if name.lower() in _CATALOG_LOWER:
        return _CATALOG_LOWER[name.lower()]
    try:
        pattern = re.compile(name, re.IGNORECASE)
    except re.error:
        pattern = re.compile(re.escape(name), re.IGNORECASE)
    sky_cloud = SKYPILOT_CLOUD_NAMES.get(cloud.lower(), cloud) if cloud else None
    matches = [n for n, clouds in CATALOG.items()
               if pattern.search(n) and (sky_cloud is None or sky_cloud in clouds)]
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
        # "A10" must not swallow "A100"; "L4" must not swallow "L40"; digits that are a
        # memory size (GKE's nvidia-h100-80gb, GFD's NVIDIA-H200-141GB-HBM3) are not a name
        if rest[:1].isdigit() and not re.match(r"\d+gb", rest):
            continue
        return name
    return value


def same_accelerator(requested: str, offered_label: str) -> bool:
    """Does a backend GPU label satisfy a requested (canonical or custom) accelerator name?"""
    try:
        want = canonical(requested)
    except AmbiguousAcceleratorError:
        # kept as written for a cloud none of whose catalog names it matches (e.g. RTXA on
        # Kubernetes): a cluster's own label may say it
        want = requested
    have = canonical_from_label(offered_label)
    return want.lower() == have.lower() or _squash(want) == _squash(offered_label)

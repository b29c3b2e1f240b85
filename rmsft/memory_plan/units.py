"""Bytes as people write and read them: `80GiB` in (`parse_bytes`: `rmsft plan --gpu-memory`, the pods' memory
limits), `12.3 GiB` out (`gib`: every figure and message of a plan)."""

from __future__ import annotations

import re

GiB = 1 << 30


def gib(n: int | None) -> str:
    """A byte count as a plan prints it: GiB to one decimal, MiB under one GiB, "?" when unknown."""
    if n is None:
        return "?"
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.0f} MiB"


_QUANTITY = re.compile(r"^\s*([0-9.]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


ACCEPTED = "80GiB or 80Gi (binary), 80G or 80GB (decimal), 512MiB"


def parse_bytes(text: str, *, what: str | None = None) -> int:
    """`80GiB`, `80Gi` (binary), `80G`, `80GB` (decimal) or plain bytes, as a Kubernetes quantity reads (a pod's
    memory limit). With `what` (an option a person types, e.g. `--gpu-memory`) a size needs its unit: `80` there
    is much more likely 80 GiB than 80 bytes, and reading it as bytes would report "does not fit" about a
    KV cache instead of the missing unit; and a size must be more than zero."""
    m = _QUANTITY.match(str(text))
    unit = m.group(2).lower() if m else None
    name = f"{what} " if what else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{name}{text!r} is not a memory size (e.g. {ACCEPTED})")
    if what is not None and unit == "":
        raise ValueError(
            f"{name}{text!r} has no unit: write {m.group(1)}GiB (binary) or {m.group(1)}GB "
            f"(decimal); accepted forms: {ACCEPTED}"
        )
    try:
        n = int(float(m.group(1)) * _UNITS[unit])
    except (ValueError, OverflowError):  # "1.2.3", "1e999"
        raise ValueError(f"{name}{text!r} is not a memory size (e.g. {ACCEPTED})") from None
    if what is not None and n <= 0:
        raise ValueError(f"{name}{text!r} must be more than zero (e.g. {ACCEPTED})")
    return n

"""Human sizes and durations: parse '20GiB', '500MB', '14d', '6h', '30m'; format them back."""

from __future__ import annotations

import re
from fractions import Fraction

from cachemgr.errors import UsageError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# a number as float() reads one ('5', '.5', '5.', '1.5'), in ASCII digits only (float() reads '１０' too)
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$", re.ASCII)


MAX_SIZE = (1 << 63) - 1


def parse_size(text: str | int) -> int:
    """Bytes from '20GiB', '500MB', '1.5G' or a plain integer; a fraction of a byte is dropped
    ('1.1GiB'), but a size under one byte that is not 0 ('0.4B') is refused: cut down to 0, as
    a cap it evicts everything."""
    if isinstance(text, int):
        return text
    match = _NUMBER_UNIT.match(str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _SIZE_UNITS:
        raise UsageError(f"invalid size {text!r}: use a number with B, KB, MB, GB, KiB, MiB, GiB, TiB")
    try:
        n = Fraction(match.group(1)) * _SIZE_UNITS[unit]  # exact: as floats, 1.1GB is 1,100,000,000.0000002
    except ValueError:  # more digits than Python converts (4,300)
        raise UsageError(f"invalid size {text!r}: too many digits") from None
    if n > MAX_SIZE:  # a database integer holds 8 bytes
        raise UsageError(f"invalid size {text!r}: larger than 8 EiB")
    if 0 < n < 1:
        raise UsageError(f"invalid size {text!r}: less than one byte (0 is written 0)")
    return int(n)


def parse_duration(text: str | int | float) -> float:
    """Seconds from '14d', '6h', '30m', '45s', '2w' or a plain number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _NUMBER_UNIT.match(str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _DURATION_UNITS:
        raise UsageError(f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 14d, 6h, 30m)")
    return float(match.group(1)) * _DURATION_UNITS[unit]


def parse_size_or_percent(text: str) -> tuple[int | None, float | None]:
    """A free-space floor: '10%' gives (None, 0.10); '50GiB' gives (bytes, None)."""
    text = str(text).strip()
    if text.endswith("%"):
        match = _NUMBER_UNIT.match(text[:-1])
        pct = float(match.group(1)) if match and not match.group(2) else -1.0
        if not 0 <= pct < 100:
            raise UsageError(f"invalid percentage {text!r}: use a number from 0 to 99, like 10%")
        return None, pct / 100
    return parse_size(text), None


def format_size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):  # (a size up to MAX_SIZE, 8 EiB)
        if abs(value) < 1024 or unit == "EiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float | None) -> str:
    """'14d', '6h', '2.5h', '90s' -> '1.5m': one unit, one decimal at most; parse_duration reads it back."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}".removesuffix(".0") + unit
    return (f"{seconds:.1f}".removesuffix(".0") if seconds < 10 else f"{seconds:.0f}") + "s"

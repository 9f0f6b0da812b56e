"""The test bed's link specs, tc-style: rates (``"1gbit"``), times (``"1ms"``) and loss (``"1%"``),
checked and turned into numbers; and the one error the test bed raises."""

from __future__ import annotations

import re

__all__ = ["TestbedError", "parse_loss", "parse_rate", "parse_time"]


class TestbedError(RuntimeError):
    """The test bed cannot be built here (not root, no iproute2, a kernel feature missing) or a
    command failed; the message is one line that says which."""

    __test__ = False  # not a pytest test class, whatever its name says


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 1024, "mibit": 1024**2, "gibit": 1024**3,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def _scaled(text: object, units: dict[str, float], default: str) -> float | None:
    """``<number><unit>`` (``unit`` one of ``units``, ``default`` when absent) as a number in the
    base unit; None when ``text`` is not of that form."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in units):
        return None
    return float(m.group(1)) * units[unit or default]


def parse_rate(rate: str) -> float:
    """Bits per second from a tc-style rate: ``"1gbit"`` -> 1e9. Like tc, ``bps`` means *bytes*/s.

    Why parse at all: tbf's burst and queue sizes and netem's packet limit derive from the rate,
    and the figure goes to tc as plain ``<n>bit`` so both sides agree on what was meant."""
    bps = _scaled(rate, _RATE_UNITS, "bit")
    if bps is None:
        raise TestbedError(f"bad rate {rate!r}: expected a number and one of {', '.join(_RATE_UNITS)}, e.g. '1gbit'")
    if not 8e3 <= bps <= 1e12:
        raise TestbedError(f"rate {rate!r} out of range (8kbit .. 1tbit)")
    return bps


def parse_time(value: str | float) -> float:
    """Seconds from ``"1ms"``, ``"250us"``, ``"0.5s"`` or a number of seconds."""
    if isinstance(value, (int, float)):
        sec = float(value)
    else:
        scaled = _scaled(value, _TIME_UNITS, "s")
        if scaled is None:
            raise TestbedError(f"bad time {value!r}: expected e.g. '1ms', '250us', '0.1s'")
        sec = scaled
    if not 0 <= sec <= 60:
        raise TestbedError(f"time {value!r} out of range (0 .. 60 s)")
    return sec


def parse_loss(value: str | float) -> float:
    """A probability from ``"1%"``, ``"0.5%"`` or a fraction like ``0.01``."""
    try:
        if isinstance(value, str) and value.strip().endswith("%"):
            p = float(value.strip()[:-1]) / 100
        else:
            p = float(value)
    except ValueError:
        raise TestbedError(f"bad loss {value!r}: expected e.g. '1%' or 0.01") from None
    if not 0 <= p < 1:
        raise TestbedError(f"loss {value!r} out of range (0 .. <100%)")
    return p

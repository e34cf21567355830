"""The text forms of counts and sizes that users type: one parser each, one error text each.

- A **count** (parameters, elements): ``7B``, ``1.5e9``, ``125M``, ``350k``, ``1_000_000``.
  Suffixes K, M, B or G, T are powers of 1000 (any case); binary and byte suffixes (``GiB``,
  ``MB``) are sizes, not counts, and are refused.
- A **size** in bytes: ``64``, ``64B``, ``2KB``, ``1.5MB``, ``1GiB``, ``1e9``. K/KB, M/MB, G/GB,
  T/TB are powers of 1000, Ki/KiB … Ti/TiB powers of 1024 (any case).

Both are exact (decimal arithmetic, no float rounding of large values), round to the nearest
whole number and refuse anything below the minimum. Pure; :class:`~shardckpt.errors.ConfigError`
names the option and the text.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

from shardckpt.errors import ConfigError

_NUMBER = r"(\d(?:_?\d)*(?:\.(?:\d(?:_?\d)*)?)?|\.\d(?:_?\d)*)(?:[eE]([+-]?\d{1,4}))?"
_COUNT = re.compile(rf"\s*{_NUMBER}\s*([A-Za-z]*)\s*")
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_SIZE_SUFFIX = {"": 1, "b": 1,
                **{f"{p}{b}": 1000 ** (i + 1) for i, p in enumerate("kmgt") for b in ("", "b")},
                **{f"{p}i{b}": 1 << 10 * (i + 1) for i, p in enumerate("kmgt") for b in ("", "b")}}
#: Values past this are typing errors, not quantities (and keep Decimal's exponents small).
_LIMIT = 10**24

COUNT_HELP = "a count such as 1_000_000, 1e6, 125M, 7B or 2.5e9 (K, M, B/G, T are powers of 1000)"
SIZE_HELP = "a size in bytes such as 65536, 64KiB, 32MB or 1GiB"


class QuantityError(ConfigError):
    """A count or size option could not be read; ``option`` names it, ``text`` is what was given."""

    def __init__(self, option: str, text: str, reason: str) -> None:
        shown = text if text and text.isprintable() and " " not in text else repr(text)
        super().__init__(f"{option} {shown}: {reason}")
        self.option, self.text, self.reason = option, text, reason


def _scaled(option: str, text: str, number: str, exponent: str | None, scale: int,
            minimum: int, expected: str) -> int:
    try:
        value = Decimal(number.replace("_", "")) * scale
        if exponent is not None:
            value = value.scaleb(int(exponent))
    except (InvalidOperation, ValueError):
        raise QuantityError(option, text, f"expected {expected}") from None
    if value > _LIMIT:
        raise QuantityError(option, text, f"larger than {_LIMIT:.0e}; expected {expected}")
    whole = int(value.to_integral_value(ROUND_HALF_EVEN))
    if whole < minimum:
        raise QuantityError(option, text, f"must be at least {minimum}")
    return whole


def parse_count(text: str, option: str = "--params", minimum: int = 1) -> int:
    """A count typed by a user (see the module docstring)."""
    m = _COUNT.fullmatch(text)
    suffix = m.group(3).lower() if m else ""
    if m is None or suffix not in _COUNT_SUFFIX:
        why = (f"{suffix!r} is a size unit; counts take K, M, B/G or T" if m and suffix in _SIZE_SUFFIX
               else f"expected {COUNT_HELP}")
        raise QuantityError(option, text, why)
    return _scaled(option, text, m.group(1), m.group(2), _COUNT_SUFFIX[suffix], minimum, COUNT_HELP)


def parse_size(text: str, option: str, minimum: int = 1) -> int:
    """A size in bytes typed by a user (see the module docstring)."""
    m = _COUNT.fullmatch(text)
    unit = m.group(3).lower() if m else ""
    if m is None or unit not in _SIZE_SUFFIX:
        raise QuantityError(option, text, f"expected {SIZE_HELP}")
    return _scaled(option, text, m.group(1), m.group(2), _SIZE_SUFFIX[unit], minimum, SIZE_HELP)

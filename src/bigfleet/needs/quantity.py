"""Kubernetes quantity strings as exact integer milli-units.

Demand and supply are compared millions of times per cycle, so every quantity is parsed once into an
``int`` of milli-units (1 cpu = 1000, 1Gi of memory = 1073741824000) and compared exactly afterwards.
Like Kubernetes' ``MilliValue()``, anything finer than a milli-unit is rounded up (away from zero).
"""

from __future__ import annotations

import re

from bigfleet.needs.errors import ValidationError

# Kubernetes stores MilliValue in an int64; anything beyond it is not a usable quantity.
MAX_MILLI = (1 << 63) - 1
# Longest quantity string accepted (k8s has no limit; ours keeps hostile input cheap to reject).
MAX_QUANTITY_LEN = 64

_POW10: list[int] = [10**i for i in range(160)]
_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL_EXP = {"m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

_QUANTITY_RE = re.compile(
    r"""
    (?P<sign>[+-])?
    (?P<int>[0-9]*)
    (?:\.(?P<frac>[0-9]*))?
    (?:
        (?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)
      | [eE](?P<exp>[+-]?[0-9]+)
      | (?P<dec>[mkMGTPE])
    )?
    """,
    re.VERBOSE,
)


# Demand and supply reuse a handful of distinct strings ("4", "16Gi", "500m"); remembering them makes
# parsing a dict lookup. Bounded: cleared when full. Errors are never cached.
_CACHE: dict[str, int] = {}
_CACHE_MAX = 8192


def parse_quantity(s: str, field: str = "") -> int:
    """`s` (``500m``, ``2Gi``, ``1e3``, ``1.5``, ``100Ki``, ``5n``...) as an exact count of milli-units.

    Raises ``ValidationError`` naming `field` when `s` is not a Kubernetes quantity or does not fit in
    an int64 of milli-units. Sub-milli suffixes ``n`` and ``u`` are accepted and rounded up.
    """
    if type(s) is str:
        hit = _CACHE.get(s)
        if hit is not None:
            return hit
    v = _parse(s, field)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[s] = v
    return v


def _parse(s: str, field: str) -> int:
    if not isinstance(s, str):
        raise ValidationError(field, f"quantity must be a string, got {type(s).__name__}")
    text = s.strip() if s[:1].isspace() or s[-1:].isspace() else s
    if not text:
        raise ValidationError(field, "empty quantity")
    if len(text) > MAX_QUANTITY_LEN:
        raise ValidationError(field, f"quantity longer than {MAX_QUANTITY_LEN} characters")
    # n (nano) and u (micro) are valid k8s suffixes the main regex leaves out because they are
    # finer than our unit; handle them up front.
    sub_milli = 0
    if text[-1] in "nu" and len(text) > 1:
        sub_milli = -9 if text[-1] == "n" else -6
        text = text[:-1]
        if not text or text[-1] not in "0123456789.":
            raise ValidationError(field, f"malformed quantity {s!r}")
    m = _QUANTITY_RE.fullmatch(text)
    if m is None:
        raise ValidationError(field, f"malformed quantity {s!r}")
    int_part = m.group("int") or ""
    frac_part = m.group("frac") or ""
    if not int_part and not frac_part:
        raise ValidationError(field, f"malformed quantity {s!r}: no digits")
    if sub_milli and (m.group("bin") or m.group("exp") is not None or m.group("dec") is not None):
        raise ValidationError(field, f"malformed quantity {s!r}")
    # value = digits / 10**len(frac) × multiplier, kept as an exact integer fraction num/den.
    digits = int(int_part + frac_part)
    den = _POW10[len(frac_part)]
    if m.group("bin"):
        num = digits * _BINARY[m.group("bin")] * 1000
    else:
        if sub_milli:
            exp10 = sub_milli
        elif m.group("exp") is not None:
            exp10 = int(m.group("exp"))
            if abs(exp10) > 40:
                if digits == 0:
                    exp10 = 0
                elif exp10 < 0:
                    # Tiny positive values still round up to one milli-unit.
                    exp10 = -40
                else:
                    raise ValidationError(field, f"quantity {s!r} is out of range")
        else:
            exp10 = _DECIMAL_EXP[m.group("dec") or ""]
        exp10 += 3  # to milli-units
        if exp10 >= 0:
            num = digits * _POW10[exp10]
        else:
            num = digits
            den *= _POW10[-exp10]
    milli = -(-num // den)  # ceiling
    if milli > MAX_MILLI:
        raise ValidationError(field, f"quantity {s!r} is out of range")
    return -milli if m.group("sign") == "-" else milli


_BIN_SUFFIXES = (("Ei", 1 << 60), ("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


def format_quantity(milli: int) -> str:
    """The canonical string for `milli` milli-units; ``parse_quantity(format_quantity(x)) == x``.

    Whole values that are a multiple of 1024 use the largest exact binary suffix (``8Gi``), other
    whole values are plain integers (``24``), and fractional values are milli-units (``1500m``).
    """
    if milli < 0:
        return "-" + format_quantity(-milli)
    whole, rem = divmod(milli, 1000)
    if rem:
        return f"{milli}m"
    if whole:
        for suffix, size in _BIN_SUFFIXES:
            if whole % size == 0:
                return f"{whole // size}{suffix}"
    return str(whole)

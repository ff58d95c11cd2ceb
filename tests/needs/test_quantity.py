# mypy: disable-error-code="arg-type,no-untyped-call,unused-ignore"
"""Kubernetes quantity parsing into exact milli-units, and canonical formatting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.needs import MAX_MILLI, ValidationError, format_quantity, parse_quantity

GI = 1 << 30


@pytest.mark.parametrize(
    ("text", "milli"),
    [
        ("0", 0),
        ("1", 1000),
        ("96", 96_000),
        ("500m", 500),
        ("1500m", 1500),
        ("1.5", 1500),
        (".5", 500),
        ("1.", 1000),
        ("0.001", 1),
        ("0.0001", 1),  # finer than a milli-unit rounds up
        ("1.0001", 1001),
        ("5n", 1),
        ("1000000n", 1),
        ("1000001n", 2),
        ("3u", 1),
        ("1000u", 1),
        ("2000u", 2),
        ("1k", 1_000_000),
        ("1M", 10**9),
        ("1G", 10**12),
        ("1T", 10**15),
        ("1P", 10**18),
        ("1Ki", 1024 * 1000),
        ("100Ki", 102_400_000),
        ("1Mi", (1 << 20) * 1000),
        ("2Gi", 2 * GI * 1000),
        ("768Gi", 768 * GI * 1000),
        ("1.5Gi", 3 * GI * 1000 // 2),
        ("1Ti", (1 << 40) * 1000),
        ("1Pi", (1 << 50) * 1000),
        ("1e3", 1_000_000),
        ("1E3", 1_000_000),
        ("1e+3", 1_000_000),
        ("1e-3", 1),
        ("1e-4", 1),
        ("2.5e2", 250_000),
        ("-1", -1000),
        ("+2", 2000),
        ("-500m", -500),
        ("-0.0001", -1),  # rounds away from zero like MilliValue
        (" 4 ", 4000),
        ("0e999999", 0),
        ("1e-999", 1),
    ],
)
def test_parse(text: str, milli: int) -> None:
    assert parse_quantity(text) == milli


@pytest.mark.parametrize(
    "text",
    ["", " ", "abc", "1x", "1 Gi", "1GiB", "Gi", "m", "1..5", "--1", "1e", "1e1.5", "1Ki5", "e3", ".", "1mm", "1nn",
     "1Mn", "n", "1e3n", "0x10", "1_000", "1E", "9223372036854775808", "1e40", "9Ei", "1" * 70],
)
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValidationError) as ei:
        parse_quantity(text, "aggregate_resources[\"cpu\"]")
    assert ei.value.field == 'aggregate_resources["cpu"]'


def test_parse_rejects_non_string() -> None:
    with pytest.raises(ValidationError):
        parse_quantity(5, "x")  # type: ignore[arg-type]


def test_largest_value_fits_int64() -> None:
    assert parse_quantity("9223372036854775807m") == MAX_MILLI
    with pytest.raises(ValidationError):
        parse_quantity("9223372036854775808m")


@pytest.mark.parametrize(
    ("milli", "text"),
    [
        (0, "0"),
        (1, "1m"),
        (500, "500m"),
        (1500, "1500m"),
        (1000, "1"),
        (24_000, "24"),
        (16_000, "16"),
        (8 * GI * 1000, "8Gi"),
        (192 * GI * 1000, "192Gi"),
        (1024 * 1000, "1Ki"),
        (1536 * 1000, "1536"),  # not a whole multiple of 1024: plain integer
        (-500, "-500m"),
    ],
)
def test_format(milli: int, text: str) -> None:
    assert format_quantity(milli) == text


@settings(deadline=None)
@given(st.integers(min_value=-MAX_MILLI, max_value=MAX_MILLI))
def test_format_round_trips(milli: int) -> None:
    assert parse_quantity(format_quantity(milli)) == milli


@settings(deadline=None)
@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "Ti"]),
)
def test_parse_integer_with_suffix_is_exact(n: int, suffix: str) -> None:
    factor = {"": 1000, "m": 1, "k": 10**6, "M": 10**9, "G": 10**12, "Ki": 1024_000, "Mi": (1 << 20) * 1000,
              "Gi": (1 << 30) * 1000, "Ti": (1 << 40) * 1000}[suffix]
    if n * factor > MAX_MILLI:
        with pytest.raises(ValidationError):
            parse_quantity(f"{n}{suffix}")
    else:
        assert parse_quantity(f"{n}{suffix}") == n * factor


@settings(deadline=None)
@given(st.decimals(min_value=0, max_value=10**9, places=6, allow_nan=False, allow_infinity=False))
def test_decimal_rounds_up_to_milli(d: object) -> None:
    from decimal import ROUND_CEILING, Decimal

    assert isinstance(d, Decimal)
    text = format(d, "f")
    expected = int((d * 1000).to_integral_value(rounding=ROUND_CEILING))
    assert parse_quantity(text) == expected


@st.composite
def k8s_quantities(draw: st.DrawFn) -> str:
    """Strings in the Kubernetes quantity grammar (non-negative)."""
    whole = draw(st.text(alphabet="0123456789", min_size=0, max_size=8))
    frac = draw(st.none() | st.text(alphabet="0123456789", min_size=0, max_size=6))
    if not whole and not frac:
        whole = "0"
    number = whole + ("" if frac is None else "." + frac)
    suffix = draw(
        st.sampled_from(["", "n", "u", "m", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti"])
        | st.integers(min_value=-12, max_value=9).map(lambda e: f"e{e}")
    )
    return number + suffix


@settings(deadline=None)
@given(k8s_quantities())
def test_matches_the_kubernetes_client_parser(text: str) -> None:
    """Differential check against the kubernetes Python client's Decimal parser (MilliValue = ceil)."""
    import decimal

    from kubernetes.utils import parse_quantity as k8s_parse

    with decimal.localcontext() as ctx:
        ctx.prec = 200
        expected = int((k8s_parse(text) * 1000).to_integral_value(rounding=decimal.ROUND_CEILING))
    if expected > MAX_MILLI:
        with pytest.raises(ValidationError):
            parse_quantity(text)
    else:
        assert parse_quantity(text) == expected


@settings(deadline=None)
@given(st.integers(min_value=0, max_value=MAX_MILLI))
def test_formatted_strings_are_valid_kubernetes_quantities(milli: int) -> None:
    """What we put on the wire (and operators copy into CRs) parses to the same value in Kubernetes."""
    import decimal

    from kubernetes.utils import parse_quantity as k8s_parse

    with decimal.localcontext() as ctx:
        ctx.prec = 200
        assert k8s_parse(format_quantity(milli)) * 1000 == milli

import math
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modbench.config.capacity import CapacitySchedule
from modbench.errors import ModbenchError
from modbench.config.patterns import parse_pattern, pattern_string


def test_seed_000_log_capacity_table():
    """Seed 000's table for C = 0.125, max_T = 2048, computed with its own formula.

    Seed 000 prints 210 for T = 1024; its formula gives C_eff = 1 − (10/11)·0.875 = 0.20454…
    and 0.20454… · 1024 = 209.45, so int() gives 209. The printed 210 is 0.205 (the rounded
    C_eff) × 1024; we follow the formula, not the rounding slip.
    """
    s = CapacitySchedule(0.125, "log", max_seq_len=2048)
    assert {T: s.k(T) for T in (1, 64, 256, 1024, 2048)} == {1: 1, 64: 33, 256: 93, 1024: 209, 2048: 256}
    assert s.effective(1024) == pytest.approx(0.2045, abs=1e-4)
    assert s.effective(2048) == pytest.approx(0.125)


def test_constant_capacity_floor_and_minimum_one():
    s = CapacitySchedule(0.125)
    assert s.k(1024) == 128 and s.k(7) == 1 and s.k(1) == 1
    # 0.57 · 100 = 56.99999999999999 in floating point: must still be 57, not 56.
    assert CapacitySchedule(0.57).k(100) == 57
    assert CapacitySchedule(1.0).k(37) == 37


@settings(max_examples=300, deadline=None)
@given(
    c=st.decimals(min_value=Decimal("0.0001"), max_value=Decimal("1"), places=4),
    T=st.integers(min_value=1, max_value=8192),
)
def test_k_is_floor_of_decimal_capacity_times_T(c, T):
    k = CapacitySchedule(float(c)).k(T)
    assert k == max(1, math.floor(c * T))
    assert 1 <= k <= T


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), "abc", None])
def test_capacity_out_of_range_is_rejected(bad):
    with pytest.raises(ModbenchError, match=r"expected a fraction in \(0, 1\]"):
        CapacitySchedule(bad)


def test_unknown_schedule_is_rejected():
    with pytest.raises(ModbenchError, match="'constant' or 'log'"):
        CapacitySchedule(0.5, "linear")


@pytest.mark.parametrize(
    "spec,n,expected",
    [
        ("alternate", 6, "DMDMDM"),
        ("all", 3, "MMM"),
        ("fixed:5,1", 8, "DDDDDMMD"),
        ("fixed:1,1", 4, "DMMD"),
        ("every:3", 7, "DDMDDMD"),
        ("every:1", 3, "MMM"),
        ("DDM", 7, "DDMDDMD"),
        ("M", 2, "MM"),
        ("D", 2, "DD"),
    ],
)
def test_pattern_strings(spec, n, expected):
    assert pattern_string(parse_pattern(spec, n)) == expected


@pytest.mark.parametrize("bad", ["", "alternating", "fixed:5", "fixed:a,b", "every:0", "every:", "DXM", "fixed:3,1"])
def test_bad_patterns_are_one_line_errors_listing_the_forms(bad):
    with pytest.raises(ModbenchError) as e:
        parse_pattern(bad, 4)
    msg = str(e.value)
    assert "\n" not in msg and "alternate" in msg and "fixed:S,E" in msg and "every:K" in msg

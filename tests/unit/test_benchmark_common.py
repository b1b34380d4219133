"""The sandbox benchmarks' shared helpers (benchmarks/common.py): how rounds are interleaved,
how ratios and their ranges are summarised, how slurmctld's time stamps are read.

Not a benchmark: the numbers are in benchmarks/README.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common  # benchmarks/ is not a package: on sys.path above


def test_interleaved_flips_the_order_every_other_round():
    calls: list[str] = []
    got = common.interleaved(4, {"a": lambda: calls.append("a") or len(calls),
                                 "b": lambda: calls.append("b") or len(calls)})
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert got == {"a": [1, 4, 5, 8], "b": [2, 3, 6, 7]}


def test_ratios_are_per_round_and_spread_gives_median_and_range():
    r = common.ratios([2.0, 3.0, 9.0], [1.0, 2.0, 3.0])
    assert r == [2.0, 1.5, 3.0]
    s = common.spread(r)
    assert (s.median, s.low, s.high, s.n) == (2.0, 1.5, 3.0, 3)
    assert s.fmt() == "2.00x (1.50-3.00, n=3)"
    with pytest.raises(ValueError):
        common.ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        common.spread([])


def test_slurm_stamps_are_local_time_to_the_millisecond():
    t = common.parse_slurm_stamp("2026-12-01T04:40:44.818")
    assert t == pytest.approx(time.mktime(time.strptime("2026-12-01T04:40:44",
                                                        "%Y-%m-%dT%H:%M:%S")) + 0.818)
    assert common.parse_slurm_stamp("2026-12-01T04:40:44") == pytest.approx(t - 0.818)
    assert common.parse_slurm_stamp("not a stamp") is None

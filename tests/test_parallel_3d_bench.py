"""``dtcourse.bench.parallel_3d`` at a tiny size (two plans of 4 ranks, one round): what ``measure`` returns and
its table. Only the structure is checked: speed is measured by the benchmark, never asserted here."""

import math

import pytest

from dtcourse.bench import parallel_3d as bench

PLANS = [(4, 1, 1, 1, "1f1b", 1), (2, 2, 1, 3, "gpipe", 1)]


def test_one_row_per_plan_timed_and_paired_against_the_first():
    rows = bench.measure(PLANS, warmup=0, steps=1)
    assert [r["plan"] for r in rows] == ["(4,1,1) ZeRO-1 1f1b", "(2,2,1) ZeRO-3 gpipe"]
    assert rows[0]["ratio"] == 1.0 and all(math.isfinite(r["ratio"]) and r["step"]["median_ms"] > 0 for r in rows)
    assert rows[0]["sent"]["pp"] == 0 < rows[1]["sent"]["pp"] and rows[1]["sent"]["tp"] == 0
    assert "(2,2,1) ZeRO-3 gpipe" in bench.table(rows)


def test_plans_of_different_sizes_are_refused():
    with pytest.raises(ValueError, match="every plan must use the same number of ranks, got \\[2, 4\\]"):
        bench.measure([PLANS[0], (2, 1, 1, 1, "1f1b", 1)])

"""``dtcourse.bench.zero`` at ``--quick`` size, 2 ranks: what ``measure`` returns, its table and its plot.

Only the structure and the bytes are checked: speed is measured by the benchmark, never asserted here.
"""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from dtcourse.bench import zero as bench  # noqa: E402
from dtcourse.models import DDP_GPT, GPT  # noqa: E402
from dtcourse.zero import default_units  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def rows():
    # --quick's sizes: 4 x 32 tokens per rank, 1 warm-up and 3 timed rounds
    return bench.measure(2, list(bench.VARIANTS), DDP_GPT, batch_size=4, seq_len=32, warmup=1, steps=STEPS)


def test_one_row_per_variant_with_every_timed_step(rows):
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    for r in rows:
        assert r["world_size"] == 2 and len(r["times"]) == STEPS
        assert all(t > 0 for t in r["times"])
        assert r["q1_ms"] <= r["median_ms"] <= r["q3_ms"]


def test_zero_variants_report_the_bytes_of_the_formula(rows):
    flats = 1 + len(default_units(GPT(DDP_GPT)))     # the units and the root, at most
    for r in rows:
        if r["variant"].startswith("ZeRO"):
            # each flat is padded to a multiple of N = 2, one fp32 element at most, sent 3 times at most
            assert 0 <= r["sent"] - r["formula"] <= 3 * 4 * flats, r
            assert r["collectives"] > 0
        else:                                 # DDP's and FSDP2's bytes are not visible: the formula alone
            assert r["sent"] is None and r["collectives"] is None
    by_name = {r["variant"]: r for r in rows}
    psi = sum(p.numel() for p in GPT(DDP_GPT).parameters())
    assert by_name["ZeRO-0"]["formula"] == 2 * 4 * psi / 2          # 2Ψ(N-1)/N, fp32
    assert by_name["ZeRO-3"]["formula"] == 3 * 4 * psi / 2          # 3Ψ(N-1)/N
    assert by_name["ZeRO-3 keep"]["sent"] == by_name["ZeRO-1"]["sent"]


def test_paired_ratios_table_and_plot(rows):
    fsdp2 = next(r for r in rows if r["variant"] == bench.FSDP2)
    assert bench.paired(fsdp2, rows, bench.FSDP2) == 1.0
    assert bench.paired(rows[0], rows, "no such variant") is None
    text = bench.table(rows)
    for name in bench.VARIANTS:
        assert name in text
    assert len(text.splitlines()) == 2 + len(rows)
    fig = bench.plot(rows, "quick")
    assert len(fig.axes[0].patches) == len(rows)

"""``dtcourse.bench.moe`` at ``--quick`` size, 2 ranks: what ``measure`` returns, its table and its plot.

Only the structure and the bytes are checked: speed is measured by the benchmark, never asserted here.
"""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from dtcourse.bench import moe as bench  # noqa: E402
from dtcourse.models import GPT  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def rows():
    return bench.measure(2, list(bench.VARIANTS), bench.MOE_GPT, batch_size=4, seq_len=32, warmup=1, steps=STEPS)


def test_one_row_per_variant_with_every_timed_step(rows):
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    for r in rows:
        assert r["world_size"] == 2 and len(r["times"]) == STEPS and all(t > 0 for t in r["times"])
        assert r["q1_ms"] <= r["median_ms"] <= r["q3_ms"]


def test_bytes_against_the_formulas(rows):
    by = {r["variant"]: r for r in rows}
    assert by["EP padded"]["a2a_sent"] == by["EP padded"]["a2a_formula"] > 0          # padded: exactly the formula
    assert 0 < by["EP dropless"]["a2a_sent"] < by["EP padded"]["a2a_sent"]            # nothing padded, nothing dropped
    assert by["all experts padded"]["a2a_sent"] is None
    model = GPT(bench.MOE_GPT)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    # all experts on every rank all-reduce the experts' gradients too: E/N of them live on each EP rank instead
    assert by["all experts padded"]["all_reduce"] - by["EP padded"]["all_reduce"] == 2 * 0.5 * 4 * experts
    assert by["EP padded"]["experts_per_rank"] == 4 and by["all experts dropless"]["experts_per_rank"] == 8


def test_table_plot_and_bad_world_size(rows):
    text = bench.table(rows)
    assert all(v in text for v in bench.VARIANTS) and len(text.splitlines()) == 2 + len(rows)
    assert len(bench.plot(rows, "quick").axes[0].patches) == len(rows)
    with pytest.raises(ValueError, match="8 experts do not spread over 3 ranks"):
        bench.measure(3)

"""``dtcourse.bench.pipeline`` at ``--quick`` size, 2 ranks: what ``measure`` returns, its table and its plot.

Only the structure is checked, and the bubble arithmetic on a hand-made timeline: speed is measured by
the benchmark, never asserted here.
"""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from dtcourse.bench import pipeline as bench  # noqa: E402
from dtcourse.pipeline.cost import bubble_formula  # noqa: E402
from dtcourse.runtime.timeline import Timeline  # noqa: E402

STEPS, M = 3, 4


@pytest.fixture(scope="module")
def rows():
    # --quick's sizes: 8 x 32 tokens in 4 micro-batches, 1 warm-up and 3 timed rounds
    return bench.measure(2, list(bench.SCHEDULE_NAMES), bench.PIPE_GPT, batch_size=8, seq_len=32,
                         microbatches=M, warmup=1, steps=STEPS)


def test_one_row_per_schedule_with_both_engines_timed_every_step(rows):
    assert [r["schedule"] for r in rows] == list(bench.SCHEDULE_NAMES)
    assert [r["torch_class"] for r in rows] == ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                                                "ScheduleInterleavedZeroBubble"]
    for r in rows:
        assert r["world_size"] == 2 and r["microbatches"] == M
        for engine in bench.ENGINES:
            times = r[engine]
            assert len(times["times"]) == STEPS and all(t > 0 for t in times["times"])
            assert times["q1_ms"] <= times["median_ms"] <= times["q3_ms"]
        assert r["ratio"] > 0


def test_bubbles_are_shares_of_the_step_beside_the_formula(rows):
    for r in rows:
        assert 0 <= r["bubble"] < 1 and len(r["bubble_per_rank"]) == 2
        assert all(0 <= b < 1 for b in r["bubble_per_rank"])
        assert 0 <= r["wait"] < 1 and 0 <= r["post"] < 1
        assert r["formula"] == bubble_formula(r["schedule"], 2, M, r["chunks"])
        assert 0 <= r["simulated"] < 1 and r["window_ms"] > 0
    split = {r["schedule"]: set(r["mean_ms"]) for r in rows}
    assert split["1f1b"] == {"F", "B"} and split["zb_h1"] == {"F", "I", "W"}   # ZB-H1 splits every backward


def test_step_summary_counts_compute_as_busy_and_a_batch_of_messages_once():
    timeline = Timeline(origin=0.0)
    timeline.record("recv", "1RECV_F0", 0.0, 1.0)
    timeline.record("wait", "wait 1F0", 1.0, 3.0)
    timeline.record("forward", "1F0", 3.0, 5.0)
    timeline.record("send", "1SEND_F0", 5.0, 5.5)            # posted together: one batch, 0.5 s
    timeline.record("recv", "1RECV_B0", 5.0, 5.5)
    timeline.record("backward", "1B0", 6.0, 10.0)
    summary = bench._step_summary(timeline)
    assert (summary["first"], summary["last"], summary["busy"]) == (3.0, 10.0, 6.0)
    assert (summary["wait"], summary["post"]) == (2.0, 1.5)
    assert summary["counts"] == {"recv": 2, "wait": 1, "forward": 1, "send": 1, "backward": 1}


def test_table_and_plot(rows):
    text = bench.table(rows)
    assert len(text.splitlines()) == 2 + len(rows)
    for r in rows:
        assert r["schedule"] in text and r["torch_class"] in text
    fig = bench.plot(rows, "quick")
    times, bubbles = fig.axes[0], fig.axes[1]
    assert len(times.patches) == 2 * len(rows) and len(bubbles.patches) == 2 * len(rows)
    assert [p.get_height() for p in bubbles.patches[len(rows):]] == [r["formula"] for r in rows]

"""Timelines (``dtcourse.runtime.timeline``, drawn by ``dtcourse.lab.timeline``; DDP's in
``dtcourse.lab.data_parallel``): the recorder, merging clocks, DDP corrections, the Gantt figure and its widget, real DDP steps.

The figure tests assert that every bar is exactly a recorded span. The real-run tests assert only
orderings that follow from the algorithm (an overlapped bucket is launched inside the hook of the
gradient that completes it), never durations.
"""

import pickle
import time
from collections import Counter

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from dtcourse.lab.data_parallel import ddp_spans, ddp_timeline_widget, overlap_summary  # noqa: E402
from dtcourse.lab.timeline import TimelineView, timeline_figure, timeline_widget  # noqa: E402
from dtcourse.models import DDP_GPT, GPT  # noqa: E402
from dtcourse.runtime.timeline import Span, Timeline, merge  # noqa: E402


def test_recorder_stores_spans_relative_to_its_origin_and_pickles():
    tl = Timeline(origin=100.0)
    tl.record("forward", "forward", 100.5, 101.25)        # absolute seconds
    tl.record("grad", "w", 101.5, 101.5)                  # a point
    assert tl.spans == [Span("forward", "forward", 0.5, 1.25), Span("grad", "w", 1.5, 1.5)]
    assert tl.spans[0].duration == 0.75
    with pytest.raises(ValueError, match="ends .* before it starts"):
        tl.record("wait", "bucket 0", 2.0, 1.0)
    copy = pickle.loads(pickle.dumps(tl))                 # what launch does with a rank's return value
    assert copy.origin == 100.0 and copy.spans == tl.spans

    tl.restart()
    assert tl.spans == [] and abs(tl.origin - time.perf_counter()) < 1.0
    with pytest.raises(KeyError):
        with tl.span("optimizer"):                        # recorded even when the body raises
            time.sleep(0.002)
            raise KeyError("boom")
    (s,) = tl.spans
    assert (s.kind, s.name) == ("optimizer", "optimizer") and 0 <= s.start and s.duration >= 0.002


def test_merge_puts_ranks_on_the_earliest_origin():
    a, b = Timeline(origin=10.0), Timeline(origin=10.25)
    a.record("backward", "backward", 10.5, 11.0)
    a.record("forward", "forward", 10.0, 10.5)
    b.record("forward", "forward", 10.25, 10.75)          # 0.25 s after rank 0's forward, on one clock
    merged = merge([a, b])
    assert merged == {0: [Span("forward", "forward", 0.0, 0.5), Span("backward", "backward", 0.5, 1.0)],
                      1: [Span("forward", "forward", 0.25, 0.75)]}
    assert merge({3: b}, origin=10.0) == {3: [Span("forward", "forward", 0.25, 0.75)]}


def test_ddp_spans_cuts_backward_at_the_last_gradient():
    raw = {0: [Span("backward", "backward", 1.0, 5.0),
               Span("grad", "w1", 2.0, 2.0), Span("grad", "w0", 3.0, 3.0),
               Span("all_reduce", "bucket 0", 3.0, 3.4), Span("all_reduce", "bucket 1", 3.5, 4.9)]}
    spans = ddp_spans(raw)[0]
    assert Span("backward", "backward", 1.0, 3.0) in spans
    assert Span("sync", "after the last gradient", 3.0, 5.0) in spans
    assert [s for s in spans if s.kind == "all_reduce"] == raw[0][3:]   # communication is left as measured
    assert ddp_spans(ddp_spans(raw)) == ddp_spans(raw)


def test_overlap_summary_measures_all_reduce_time_inside_backward():
    spans = [Span("forward", "forward", 0.0, 0.001), Span("backward", "backward", 0.001, 0.005),
             Span("grad", "w", 0.004, 0.004),                    # backward computes until 4 ms
             Span("all_reduce", "bucket 0", 0.002, 0.0045), Span("all_reduce", "bucket 1", 0.003, 0.006)]
    waits = [Span("wait", "bucket 0", 0.004, 0.0045), Span("wait", "bucket 1", 0.0045, 0.006)]
    s = overlap_summary(spans + waits)
    assert s.all_reduces == 2 and s.launched_during_backward == 2
    assert s.step_ms == pytest.approx(6.0) and s.backward_ms == pytest.approx(3.0)
    assert s.comm_ms == pytest.approx(4.0) and s.hidden_ms == pytest.approx(2.0)   # 2..6 ms, 2..4 inside
    assert s.hidden_fraction == pytest.approx(0.5)
    synchronous = overlap_summary(spans)          # no wait events: backward stood still meanwhile
    assert synchronous.comm_ms == pytest.approx(4.0) and synchronous.hidden_ms == 0.0
    with pytest.raises(ValueError, match="exactly one backward span"):
        overlap_summary(spans[:1])


RUN_A = {0: [Span("forward", "forward", 0.0, 0.002), Span("backward", "backward", 0.002, 0.006),
             Span("grad", "w", 0.003, 0.003), Span("all_reduce", "bucket 0", 0.003, 0.007),
             Span("all_reduce", "bucket 1", 0.005, 0.008), Span("wait", "bucket 1", 0.006, 0.008)],
         1: [Span("forward", "forward", 0.001, 0.003), Span("all_reduce", "bucket 0", 0.004, 0.007)]}
RUN_B = {0: [Span("forward", "forward", 0.0, 0.010)], 1: [Span("send", "to 0", 0.002, 0.020)]}


def _check_bars_are_the_spans(view, recording):
    drawn = Counter((rank, s) for rank, s, _ in view.bars)
    assert drawn == Counter((rank, s) for rank, spans in recording.items() for s in spans if s.end > s.start)
    for rank, s, bar in view.bars:
        assert bar.get_x() == pytest.approx(1e3 * s.start)
        assert bar.get_width() == pytest.approx(1e3 * s.duration)
        lane = 1 if s.kind in ("all_reduce", "send") else 0      # communication lane under compute
        top = 2 * rank + lane - 0.4                               # a lane is 0.8 high around its row
        assert top <= bar.get_y() < bar.get_y() + bar.get_height() <= top + 0.8 + 1e-9
    for rank, line in view.ticks.items():
        assert list(line.get_xdata()) == [1e3 * s.start for s in recording[rank] if s.end == s.start]


def test_figure_draws_every_span_as_a_bar_in_ms_and_stacks_overlaps():
    view = TimelineView(RUN_A, title="two ranks")
    ax = view.ax
    _check_bars_are_the_spans(view, RUN_A)
    fig = timeline_figure(RUN_A)
    assert len(fig.axes[0].patches) == len(view.bars) == 7     # the grad point is a tick, not a bar
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 compute", "rank 0 comm",
                                                            "rank 1 compute", "rank 1 comm"]
    assert ax.get_xlim()[1] == pytest.approx(1.02 * 8.0) and "ms" in ax.get_xlabel()
    # rank 0's two all-reduces overlap in time (3-7 and 5-8 ms): they must not overlap on the page
    b0, b1 = [bar for rank, s, bar in view.bars if rank == 0 and s.kind == "all_reduce"]
    (upper, lower) = sorted((b0, b1), key=lambda b: b.get_y())
    assert upper.get_y() + upper.get_height() <= lower.get_y() + 1e-9
    colours = {s.kind: bar.get_facecolor() for _, s, bar in view.bars}
    assert len(set(colours.values())) == len(colours) == 4      # one colour per kind
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(colours)


def test_widget_dropdown_redraws_the_chosen_run_on_a_shared_axis():
    box = timeline_widget({"a": RUN_A, "b": RUN_B}, titles={"a": "run a"})
    view, first_png = box.view, box.image.value
    _check_bars_are_the_spans(view, RUN_A)
    assert view.ax.get_title() == "run a" and view.ax.get_xlim()[1] == pytest.approx(1.02 * 20.0)
    box.dropdown.value = "b"
    _check_bars_are_the_spans(view, RUN_B)
    assert view.ax.get_title() == "b" and view.ax.get_xlim()[1] == pytest.approx(1.02 * 20.0)
    assert box.image.value != first_png, "choosing a run must redraw the image"
    box.dropdown.value = "a"
    box.shared.value = False                                  # run a alone: its own 8 ms, not b's 20
    _check_bars_are_the_spans(view, RUN_A)
    assert view.ax.get_xlim()[1] == pytest.approx(1.02 * 8.0)
    with pytest.raises(ValueError, match="at least one recorded run"):
        timeline_widget({})


@pytest.fixture(scope="module")
def real_runs():
    """One launch: two steps (one warm-up) of each strategy on 2 ranks, 1 MiB buckets (4 of them)."""
    return ddp_timeline_widget(world_size=2, bucket_cap_mb=1.0, steps=2)


def test_real_overlapped_ddp_launches_all_reduces_before_backward_ends(real_runs):
    runs = real_runs.runs
    assert list(runs) == ["per_parameter", "bucketed", "overlapped"]
    n_params = len(list(GPT(DDP_GPT).parameters()))
    for label, recording in runs.items():
        assert sorted(recording) == [0, 1]
        for rank, spans in recording.items():
            assert all(s.start >= 0 for s in spans), "every span follows the shared origin (after a barrier)"
            kinds = [s.kind for s in spans]
            assert kinds.count("forward") == 2 and kinds.count("backward") == kinds.count("sync") == 1
            assert kinds.count("grad") == n_params and kinds.count("optimizer") == 1
            backward_end = next(s.end for s in spans if s.kind == "backward")
            early = [s for s in spans if s.kind == "all_reduce" and s.start < backward_end]
            summary = overlap_summary(spans)
            assert summary.launched_during_backward == len(early)
            if label == "overlapped":
                # buckets 0-2 are complete before the embeddings' gradients, the last ones, exist
                assert len(early) == 3 and summary.all_reduces == 4 and kinds.count("wait") == 4
            else:
                assert early == [] and summary.hidden_ms == 0.0
                assert summary.all_reduces == (4 if label == "bucketed" else n_params)
                # synchronous all-reduces run one after another on the rank's one thread
                reduces = sorted((s for s in spans if s.kind == "all_reduce"), key=lambda s: s.start)
                assert all(a.end <= b.start for a, b in zip(reduces, reduces[1:]))


def test_real_run_widget_shows_each_strategy(real_runs):
    for label in ("overlapped", "bucketed"):
        real_runs.dropdown.value = label
        _check_bars_are_the_spans(real_runs.view, real_runs.runs[label])
        assert real_runs.view.ax.get_title().startswith(f"{label}: step ")

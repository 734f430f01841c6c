"""Lesson 01's pictures, measurements and problems (``dtcourse.lab.collectives``): the before/after
figure shows exactly the values it was given; the ring widget replays the real implementation's
messages, driven headlessly through its slider; the busbw plot draws the model it is given; the
fit is measured again when noise makes it fail; every problem's formula agrees with its measurement."""

import dataclasses

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402

from dtcourse.collectives import busbw  # noqa: E402
from dtcourse.lab import collectives as lab  # noqa: E402
from dtcourse.lab.collectives import (RingView, collectives_figure, record_ring_all_reduce,  # noqa: E402
                                      ring_states, ring_widget, source_colour)
from dtcourse.lab.problems import check  # noqa: E402
from dtcourse.lab.widgets import COLUMN_IN  # noqa: E402


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_recorded_messages_replay_to_a_full_sum(world_size):
    rec = record_ring_all_reduce(world_size, numel=2 * world_size + 1)
    everyone = frozenset(range(world_size))
    expected = sum(range(1, world_size + 1))
    assert all(all(v == expected for v in result) for result in rec.results)
    assert len(rec.messages) == world_size * 2 * (world_size - 1)   # every rank sends once per step
    states = ring_states(rec)
    assert len(states) == 2 * (world_size - 1) + 1
    assert states[0] == [[frozenset([r])] * world_size for r in range(world_size)]
    # after the reduce-scatter, rank r owns the finished chunk r and no other finished chunk
    middle = states[world_size - 1]
    for r in range(world_size):
        assert middle[r][r] == everyone
        assert sum(cell == everyone for cell in middle[r]) == 1
    assert states[-1] == [[everyone] * world_size for _ in range(world_size)]


def _luminance(colour) -> float:
    r, g, b = to_rgb(colour)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_slider_drives_the_figure():
    box = ring_widget(world_size=4, numel=8)
    view, slider, image = box.view, box.slider, box.image
    assert slider.max == view.steps == 6 and slider.value == 0
    first_png = image.value
    titles = []
    for step in range(view.steps + 1):
        slider.value = step
        assert view.step == step
        state = view.states[step]
        for (rank, chunk), (cell, label) in view.cells.items():
            assert label.get_text() == "+".join(str(r) for r in sorted(state[rank][chunk]))
            assert label.get_fontsize() >= 9
            # readable: dark text on light boxes, white on dark ones (finished chunks are navy)
            assert abs(_luminance(label.get_color()) - _luminance(cell.get_facecolor())) > 0.45, (step, rank, chunk)
        # one arrow per message of the next step: each of the 4 ranks sends one chunk per step
        assert len(view.arrows) == (4 if step < view.steps else 0)
        assert [a for a in view.ax.patches if a in view.arrows] == view.arrows
        titles.append(view.ax.get_title())
    # the title says that the boxes are the state after the step, and which step the arrows are
    assert titles[0].startswith("boxes: the start") and "arrows: step 1, reduce-scatter" in titles[0]
    assert titles[3].startswith("boxes: after step 3 of 6 (reduce-scatter)")
    assert "arrows: step 4, all-gather" in titles[3]
    assert titles[6].startswith("boxes: after all 6 steps") and "no arrows" in titles[6]
    assert view.figure.get_figwidth() <= COLUMN_IN
    assert image.value != first_png, "moving the slider must redraw the image"


def test_in_flight_messages_follow_the_ring():
    view = RingView(record_ring_all_reduce(3, 6))
    for step in range(view.steps):
        for m in view.in_flight(step):
            assert m.dst == (m.src + 1) % 3
            assert m.phase == ("reduce-scatter" if step < 2 else "all-gather")
    with pytest.raises(ValueError, match="step must be between 0 and 4"):
        view.show(5)


def test_bad_sizes():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        record_ring_all_reduce(1)
    with pytest.raises(ValueError, match="numel >= world_size"):
        record_ring_all_reduce(4, numel=2)


def test_panels_show_the_values_and_colour_them_by_source_rank():
    runs = {
        "broadcast": [([0.0, 1.0], [0.0, 1.0]), ([10.0, 11.0], [0.0, 1.0])],
        "reduce": [([0.0, 1.0], [10.0, 12.0]), ([10.0, 11.0], None)],
    }
    fig = collectives_figure(runs, n_ranks=2, columns=2)
    broadcast, reduce_ = fig.axes[:2]
    assert broadcast.get_title() == "broadcast" and reduce_.get_title() == "reduce"
    texts = [t.get_text() for t in broadcast.texts if t.get_text() not in ("→", "rank 0", "rank 1")]
    assert texts == ["0", "1", "0", "1", "10", "11", "0", "1"]
    assert "undefined" in [t.get_text() for t in reduce_.texts]
    # the sums (10 and 12 on two ranks of data 0..1 and 10..11) are outside every rank's range
    assert source_colour(0.0, 2) == "C0" and source_colour(11.0, 2) == "C1" and source_colour(25.0, 2) == "0.75"
    assert len(broadcast.patches) == 8


def _rows(seconds_of):
    """Synthetic measurement rows for plot/table, as measure() returns them."""
    rows = []
    for name in ("ring", "backend"):
        for s in (4 << 10, 1 << 20, 16 << 20):
            t = [seconds_of(name, s) * f for f in (1.0, 1.1, 0.9)]
            rows.append({"collective": "all_reduce", "algorithm": name, "world_size": 4, "nbytes": s,
                         "seconds": t[0], "times": t, "algbw": s / t[0], "busbw": busbw("all_reduce", s, t[0], 4)})
    return rows


def test_the_plot_draws_the_model_it_is_given_through_the_points_it_was_built_from():
    model = lab.LinkModel(world_size=4, alpha=1e-4, beta=1e-9, gamma=2e-10)
    rows = _rows(lambda name, s: model.predict("ring", s) * (1.0 if name == "ring" else 0.8))
    fig = lab.plot(rows, {4: model})
    ax = fig.axes[0]
    assert fig.get_figwidth() <= COLUMN_IN and ax.get_title() == "all-reduce, N = 4"
    measured, dashed = ax.lines[0], ax.lines[1]
    assert dashed.get_linestyle() == "--"
    # in MB/s, the model's line passes through the ring's measured points (they were made from it)
    assert list(measured.get_ydata()) == pytest.approx(list(dashed.get_ydata()), rel=1e-9)
    legend = fig.legends[0]
    assert {t.get_text() for t in legend.get_texts()} >= {"ring", "backend", "model (fitted α, β, γ)"}
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 8


def test_the_table_prints_small_rates_in_small_units_and_paired_ratios():
    rows = _rows(lambda name, s: (0.5 if s < (1 << 20) else 1e-3) * (1 if name == "ring" else 2))
    text = lab.table(rows)
    assert "0.000" not in text and "MB/s" in text and "kB/s" in text
    assert lab.paired_ratio(rows, "ring", "all_reduce", 4, 4 << 10) == pytest.approx(2.0)
    assert text.splitlines()[-1].rstrip().endswith("2.00")


def test_fit_link_measures_again_when_noise_spoils_the_fit(monkeypatch):
    noisy = ([(4, 3e-4), (4 << 20, 1e-4)], 1e-10)                 # the 4 MB message "ran faster"
    clean = ([(4, 5e-5), (1 << 20, 5e-5 + 1e-3), (4 << 20, 5e-5 + 4e-3)], 1e-10)
    answers = iter([[noisy], [noisy], [clean]])
    monkeypatch.setattr(lab, "launch", lambda *args, **kwargs: next(answers))
    model = lab.fit_link(4, attempts=3)
    assert model.alpha == pytest.approx(5e-5, rel=1e-3) and model.beta == pytest.approx(1e-3 / (1 << 20), rel=1e-3)
    answers = iter([[noisy]] * 2)
    monkeypatch.setattr(lab, "launch", lambda *args, **kwargs: next(answers))
    with pytest.raises(ValueError, match="too noisy"):
        lab.fit_link(4, attempts=2)


def test_fit_ping_pong_measures_again_when_noise_spoils_the_fit(monkeypatch):
    answers = iter([[(4, 3e-4), (4 << 20, 1e-4)], [(4, 5e-5), (4 << 20, 5e-5 + 4e-3)]])
    monkeypatch.setattr(lab, "ping_pong", lambda sizes, repeats: next(answers))
    samples, alpha, beta = lab.fit_ping_pong(attempts=2)
    assert samples[1][1] == pytest.approx(5e-5 + 4e-3) and alpha > 0 and beta > 0


def test_measure_times_every_collective_with_paired_iterations():
    for collective, algorithms in (("all_reduce", ("ring", "ring/2", lab.BLOCKS, "backend", lab.AGAIN)),
                                   ("reduce_scatter", ("ring", "backend")), ("all_gather", ("ring", "backend"))):
        rows = lab.measure(3, [4 << 10], algorithms, collective=collective, iterations=2)
        assert [r["algorithm"] for r in rows] == list(algorithms)
        for r in rows:
            assert r["collective"] == collective and len(r["times"]) == 2 and r["seconds"] > 0
            assert r["nbytes"] == (4 << 10) // 12 * 12            # N divides the elements, for RS and AG
            assert r["busbw"] == pytest.approx(busbw(collective, r["nbytes"], r["seconds"], 3))
        if lab.AGAIN in algorithms:                # the control is timed as the backend, a ratio like the others
            assert lab.paired_ratio(rows, lab.BLOCKS, collective, 3, rows[0]["nbytes"]) > 0
            assert lab.paired_ratio(rows, lab.AGAIN, collective, 3, rows[0]["nbytes"]) > 0


@pytest.mark.parametrize("problem, kwargs", [
    (lab.problem_ring_bytes, {"numel": 1000, "world_size": 5}),
    (lab.problem_ring_bytes, {"numel": 1001, "world_size": 3}),
    (lab.problem_sliced_messages, {"world_size": 3, "slices": 4}),
    (lab.problem_busbw_from_time, {"nbytes": 64 << 10, "seconds": 1e-3, "world_size": 8}),
    (lab.problem_tree_root_bytes, {"numel": 100, "world_size": 5}),
    (lab.problem_blocked_rounds, {"numel": 1000, "world_size": 3, "chunk_bytes": 400}),   # 4 blocks, the last of 100
    (lab.problem_blocked_rounds, {"numel": 1 << 14, "world_size": 5, "chunk_bytes": 1 << 10}),
])
def test_counted_problems_agree_and_a_wrong_formula_would_not(problem, kwargs):
    answer = problem(**kwargs)
    check(None, answer)
    wrong = dataclasses.replace(answer, formula=answer.formula * 1.05)
    with pytest.raises(AssertionError):
        check(None, wrong)


def test_the_timed_algorithms_take_every_place_in_the_order_equally_often():
    from dtcourse.bench import turns

    names = ["ring", "ring/2", "gloo"]
    orders = [turns(names, i) for i in range(6)]
    assert orders[0] == names and orders[1] == ["ring/2", "gloo", "ring"]
    for name in names:                         # over every 3 iterations, each name in each place once
        assert sorted(order.index(name) for order in orders[:3]) == [0, 1, 2]
        assert [order.index(name) for order in orders[3:]] == [order.index(name) for order in orders[:3]]

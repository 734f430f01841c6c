"""Lesson 01's pictures (``dtcourse.lab.collectives``): the before/after figure shows exactly the
values it was given; the ring widget replays the real implementation's messages, driven headlessly
through its slider."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from dtcourse.lab.collectives import (RingView, collectives_figure, record_ring_all_reduce,  # noqa: E402
                                      ring_states, ring_widget, source_colour)


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


def test_slider_drives_the_figure():
    box = ring_widget(world_size=4, numel=8)
    view, slider, image = box.view, box.slider, box.image
    assert slider.max == view.steps == 6
    first_png = image.value
    for step in range(view.steps + 1):
        slider.value = step
        assert view.step == step
        state = view.states[step]
        for (rank, chunk), (cell, label) in view.cells.items():
            assert label.get_text() == "+".join(str(r) for r in sorted(state[rank][chunk]))
        # one arrow per message in flight: each of the 4 ranks sends one chunk per step
        assert len(view.arrows) == (4 if step < view.steps else 0)
        assert [a for a in view.ax.patches if a in view.arrows] == view.arrows
    phase_titles = view.ax.get_title()
    assert phase_titles.startswith("step 6 of 6: done")
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

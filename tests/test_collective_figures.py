"""The lesson 01 before/after figure shows exactly the values it was given."""

import matplotlib

matplotlib.use("Agg")

from dtcourse.collective_figures import collectives_figure, source_colour  # noqa: E402


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

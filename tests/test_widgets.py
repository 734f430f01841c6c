"""figure_widget: setting a control's value calls the redraw with every control's value and re-renders the image,
and callbacks fired from two threads at once (as ipykernel's subshells fire them) end on the controls' last values."""

import ipywidgets as widgets
import pytest
from matplotlib.figure import Figure

from dtcourse.lab.widgets import figure_widget, png


def _line_figure():
    figure = Figure(figsize=(2, 2))
    ax = figure.subplots()
    line, = ax.plot([0, 1], [0, 0])
    ax.set_ylim(-1, 10)
    return figure, line


def test_png_is_the_rendered_figure():
    figure, _ = _line_figure()
    data = png(figure)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert png(figure) == data                              # same figure, same bytes


def test_setting_the_value_redraws_the_figure_and_the_image():
    figure, line = _line_figure()
    calls = []

    def redraw(height):
        calls.append(height)
        line.set_ydata([0, height])

    slider = widgets.IntSlider(value=0, min=0, max=9)
    box = figure_widget({"slider": slider}, redraw, figure, max_width="300px", view=line)
    assert box.slider is slider and box.view is line and box.children == (slider, box.image)
    assert box.image.format == "png" and box.image.layout.max_width == "300px"
    first = box.image.value
    assert calls == [] and first == png(figure)             # drawn once, without calling redraw
    box.slider.value = 7
    assert calls == [7] and list(line.get_ydata()) == [0, 7]
    assert box.image.value != first and box.image.value == png(figure)


def test_several_controls_sit_in_a_row_and_each_redraws_with_all_values():
    figure, line = _line_figure()
    calls = []
    dropdown = widgets.Dropdown(options=["a", "b"], value="a")
    checkbox = widgets.Checkbox(value=True)
    box = figure_widget({"dropdown": dropdown, "shared": checkbox},
                        lambda name, shared: (calls.append((name, shared)), line.set_ydata([0, len(calls)])),
                        figure)
    row, image = box.children
    assert isinstance(row, widgets.HBox) and row.children == (dropdown, checkbox) and image is box.image
    first = box.image.value
    box.dropdown.value = "b"
    box.shared.value = False
    assert calls == [("b", True), ("b", False)]
    assert box.image.value not in (first, b"") and box.image.value == png(figure)


def test_no_controls_is_an_error():
    figure, _ = _line_figure()
    with pytest.raises(ValueError, match="at least one control"):
        figure_widget({}, lambda: None, figure)


def _bars_figure(layout):
    """A figure redrawn as the course's views are: axes cleared and refilled, a layout engine at draw time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = Figure(figsize=(3, 2), layout=layout)
    FigureCanvasAgg(figure)          # as pyplot's figures: a canvas that keeps one renderer between draws
    ax = figure.subplots()

    def redraw(height, width):
        ax.clear()
        ax.bar(range(width), [height] * width, color="tab:blue")
        ax.set(ylim=(0, 10), title=f"height {height}, width {width}")
        if layout is None:           # the course's pyplot views call tight_layout in their redraw
            figure.subplots_adjust(0.125, 0.11, 0.9, 0.88)    # from matplotlib's defaults, so the layout
            figure.tight_layout()                             # depends on the values, not the draw before

    return figure, redraw


@pytest.mark.parametrize("layout", [None, "constrained"])
def test_callbacks_from_two_threads_at_once_end_on_the_last_values(layout):
    """ipykernel runs widget callbacks in subshell threads: two at once must neither blank the image for good
    (two interleaved draws of one figure can leave its renderer's drawing disabled) nor end on stale values."""
    import io
    import sys
    import threading

    import numpy as np
    from PIL import Image

    figure, redraw = _bars_figure(layout)
    redraw(1, 1)
    height, width = widgets.IntSlider(value=1, min=0, max=9), widgets.IntSlider(value=1, min=1, max=6)
    box = figure_widget({"height": height, "width": width}, redraw, figure)
    errors, start = [], threading.Barrier(2)

    def move(control, values):
        start.wait()
        try:
            for v in values:
                control.value = v
        except Exception as error:       # noqa: BLE001 -- any error a callback raised, asserted below
            errors.append(error)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)          # hand the GIL over often, so the two threads' draws interleave
    try:
        threads = [threading.Thread(target=move, args=(height, [i % 9 + 1 for i in range(40)])),
                   threading.Thread(target=move, args=(width, [i % 6 + 1 for i in range(1, 41)]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    pixels = np.asarray(Image.open(io.BytesIO(box.image.value)).convert("L"))
    assert (pixels < 128).mean() > 0.01                                     # not blank: bars and text are drawn
    expected, expected_redraw = _bars_figure(layout)
    expected_redraw(height.value, width.value)
    assert box.image.value == png(expected)                                 # the controls' final values, shown
    height.value = (height.value + 1) % 9                                   # and the widget still redraws
    expected_redraw(height.value, width.value)
    assert box.image.value == png(expected)


def test_a_page_that_cannot_run_widgets_gets_the_current_picture_and_the_settings(monkeypatch):
    import base64

    from IPython.core.formatters import DisplayFormatter

    figure, line = _line_figure()
    slider = widgets.IntSlider(value=0, min=0, max=9, description="height")
    dropdown = widgets.Dropdown(options=["a", "b"], value="a", description="kind:")
    box = figure_widget({"slider": slider, "dropdown": dropdown}, lambda h, k: line.set_ydata([0, h]), figure)
    box.slider.value = 4
    formatter = DisplayFormatter()
    monkeypatch.delenv("DTCOURSE_STATIC_WIDGETS", raising=False)
    live, _ = formatter.format(box)
    assert "application/vnd.jupyter.widget-view+json" in live and "image/png" not in live
    monkeypatch.setenv("DTCOURSE_STATIC_WIDGETS", "0")
    assert "application/vnd.jupyter.widget-view+json" in formatter.format(box)[0]
    monkeypatch.setenv("DTCOURSE_STATIC_WIDGETS", "1")
    still, _ = formatter.format(box)
    assert "application/vnd.jupyter.widget-view+json" not in still
    assert base64.b64decode(still["image/png"]) == box.image.value == png(figure)     # the picture as it stands
    assert "height = 4, kind = a" in still["text/plain"]
    assert still["image/png"] in still["text/html"] and "height = 4, kind = a" in still["text/html"]

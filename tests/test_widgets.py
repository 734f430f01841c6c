"""figure_widget: setting a control's value calls the redraw with every control's value and re-renders the image."""

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

"""A matplotlib figure shown through ipywidgets controls, redrawn whenever a control changes.

The course's widgets are thin: a view object (a ``FigureView``) owns a matplotlib figure and a
method that redraws it for given values (``RingView.show(step)``, ``TraceView.show(segments)``).
This module does the rest, the same for every lesson: it renders the figure to PNG bytes, shows
them in a ``widgets.Image`` below the controls, and re-renders when a control's value changes::

    from dtcourse.lab.widgets import figure_widget
    slider = widgets.IntSlider(min=0, max=view.steps, description="step")
    box = figure_widget({"slider": slider}, view.show, view.figure, view=view)
    box.slider.value = 3          # calls view.show(3), then box.image.value = png(view.figure)

The figure goes out as an image rather than through the inline backend, so it redraws in
place, a notebook shows it once, and a test can drive it headlessly by setting ``.value``.

ipykernel runs widget callbacks in threads, so two quick changes can redraw one figure at once.
matplotlib is not thread-safe: two interleaved draws of a figure can leave its renderer's drawing
switched off for good (a white image until the cell is re-run). Each widget therefore redraws under
its own lock, and the last change wins: a callback whose change a later draw already shows returns
at once, and one that sees a new change arrive while it draws draws again, so the image always
ends on the controls' current values.

A page that cannot run widgets (the course's static site, ``make site``) sets the environment
variable ``DTCOURSE_STATIC_WIDGETS=1`` before the kernel starts. Each widget then displays as
it stands when shown: its picture, under a line that names its controls and their values.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:   # ipywidgets is imported only when a widget is built
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = ["png", "figure_widget", "still", "FigureView", "COLUMN_IN", "DPI", "STATIC"]

STATIC = "DTCOURSE_STATIC_WIDGETS"    # set (to anything but "" or "0"): widgets display as pictures

# Every figure the course draws fits the notebook column at its natural size: at most
# COLUMN_IN inches wide, rendered at DPI (the inline backend's default, 100), so 760 px.
# A wider figure is shrunk by the browser (small text); a narrower one is never stretched.
COLUMN_IN = 7.6
DPI = 100


def png(figure: Figure, dpi: int = DPI) -> bytes:
    """The figure rendered as PNG bytes, the form a ``widgets.Image`` shows."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


class FigureView:
    """What every lesson view shares: a matplotlib ``figure`` that ``show(...)`` redraws, and its PNG."""

    figure: Figure

    def png(self) -> bytes:
        """The figure as PNG bytes, as the widget shows it."""
        return png(self.figure)


def figure_widget(controls: Mapping[str, ipywidgets.ValueWidget], redraw: Callable[..., None], figure: Figure,
                  max_width: str = f"{round(COLUMN_IN * DPI)}px", **handles: Any) -> ipywidgets.VBox:
    """The controls above an image of ``figure``; a change to any control redraws the image.

    ``redraw`` is called with every control's current value, in the order of ``controls``, and
    updates ``figure``; the image then shows the new PNG. The returned ``VBox`` carries each
    control under its key in ``controls``, the image as ``.image``, and each of ``handles``
    (``view=...``), for tests and curious students. Several controls sit side by side in a row.
    """
    import ipywidgets as widgets

    if not controls:
        raise ValueError("figure_widget needs at least one control to redraw the figure from, got none.")
    image = widgets.Image(value=png(figure), format="png", layout=widgets.Layout(max_width=max_width))
    lock = threading.RLock()        # reentrant: a redraw that sets a control must not wait on itself
    changes = itertools.count(1)    # numbers each change, in the order the values were set (next() is atomic)
    state = {"latest": 0, "drawn": 0}   # the newest change numbered, and the newest one the image shows

    def on_change(_change: dict) -> None:
        mine = state["latest"] = next(changes)
        with lock:
            if state["drawn"] >= mine:      # a later callback already drew values at least this new
                return
            while True:
                seen = state["latest"]      # the values read next include every change up to ``seen``
                redraw(*(control.value for control in controls.values()))
                image.value = png(figure)
                if state["latest"] == seen:     # no change came in while drawing: the image is current
                    state["drawn"] = max(state["drawn"], seen)
                    return

    for control in controls.values():
        control.observe(on_change, names="value")
    row = list(controls.values())
    box = widgets.VBox([row[0] if len(row) == 1 else widgets.HBox(row), image])
    for name, handle in {**controls, "image": image, **handles}.items():
        setattr(box, name, handle)
    live = box._repr_mimebundle_
    box._repr_mimebundle_ = lambda **kw: still(box) if os.environ.get(STATIC, "0") not in ("", "0") else live(**kw)
    return box


def still(box: ipywidgets.Box) -> dict[str, str]:
    """A figure widget as it stands, for a page that cannot run it: its picture (PNG) under one line
    naming each control and its value, as HTML, with the PNG and the line as fallbacks."""
    import ipywidgets as widgets

    settings, notes, pictures = [], [], []

    def walk(w: widgets.Widget) -> None:
        if isinstance(w, widgets.Image):
            pictures.append(base64.b64encode(w.value).decode())
        elif isinstance(w, (widgets.HTML, widgets.Label, widgets.HTMLMath)):
            if w.value:
                notes.append(w.value)
        elif isinstance(w, widgets.Box):
            for child in w.children:
                walk(child)
        elif hasattr(w, "value"):
            settings.append(f"{w.description.rstrip(':') or 'value'} = {w.value}")

    walk(box)
    line = ("An interactive figure: in Jupyter, change its controls to redraw it. Shown here as drawn with "
            + ", ".join(settings) + ".")
    alt = html.escape(f"the figure drawn with {', '.join(settings)}", quote=True)
    body = "".join(f'<img src="data:image/png;base64,{p}" alt="{alt}" style="max-width: 100%">' for p in pictures)
    notes_html = "".join(f"<div>{n}</div>" for n in notes)       # a widget's own note is already HTML
    page = (f'<div class="dtcourse-still"><p><em>{html.escape(line)}</em></p>{notes_html}{body}</div>')
    bundle = {"text/html": page, "text/plain": line}
    if pictures:
        bundle["image/png"] = pictures[0]
    return bundle

"""make site: every lesson executed into one HTML page, pages in lesson order with a shared bar, widgets as
their pictures, and a failing cell stops the build with the lesson's name."""

import nbformat
import pytest

from dtcourse import site

WIDGET = """import ipywidgets as widgets
from matplotlib.figure import Figure
from dtcourse.lab.widgets import figure_widget
figure = Figure(figsize=(2, 2)); line, = figure.subplots().plot([0, 1], [0, 0])
box = figure_widget({"slider": widgets.IntSlider(value=3, description="height")},
                    lambda h: line.set_ydata([0, h]), figure)
box"""


def _lesson(path, title, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\n*About 5 minutes.*\n\nText.")]
    nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_the_site_has_one_executed_page_per_lesson_in_order(tmp_path, monkeypatch):
    monkeypatch.delenv("DTCOURSE_STATIC_WIDGETS", raising=False)
    lessons = [_lesson(tmp_path / "00_first.ipynb", "00 · First", ["print(6 * 7)"]),
               _lesson(tmp_path / "01_second.ipynb", "01 · Second", [WIDGET])]
    out = tmp_path / "site"
    seconds = site.build(lessons, out, timeout=120)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    index = (out / "index.html").read_text()
    assert index.index("00_first.html") < index.index("01_second.html")
    assert "00 · First" in index and "About 5 minutes." in index
    first, second = (out / "00_first.html").read_text(), (out / "01_second.html").read_text()
    assert "42" in first                                                    # executed: the output is there
    assert 'href="01_second.html"' in first and 'href="00_first.html"' in second   # previous and next
    assert 'href="index.html"' in first and 'href="index.html"' in second
    assert "data:image/png;base64," in second and "height = 3" in second   # the widget, as a picture
    assert '<script type="application/vnd.jupyter.widget-view+json">' not in second     # no live widget left
    import os
    assert "DTCOURSE_STATIC_WIDGETS" not in os.environ           # set for the kernels only, not this process


def test_a_failing_cell_stops_the_build_and_names_the_lesson(tmp_path):
    bad = _lesson(tmp_path / "00_bad.ipynb", "00 · Bad", ["x = 1", "assert x == 2, 'x is not two'"])
    with pytest.raises(SystemExit, match="00_bad.ipynb: a cell failed") as err:
        site.build([bad], tmp_path / "site", timeout=60)
    assert "x is not two" in str(err.value)
    assert not (tmp_path / "site" / "index.html").exists()


def test_a_lessons_title_and_summary_are_its_heading_and_its_first_italic_line():
    from pathlib import Path

    title, summary = site.lesson_info(Path(site.ROOT) / "lessons" / "03_parameter_server.ipynb")
    assert title == "03 · Parameter servers" and summary.startswith("About 55 minutes")

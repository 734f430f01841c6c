"""What the lessons run and draw, one module per technique's stem: measurements, figures, widgets.

``dtcourse.lab.<stem>`` is lesson NN_<stem>'s companion; the algorithm it measures is
``dtcourse.<stem>``, which never imports this package. ``widgets.py`` is the one widget plumbing
(``FigureView``, ``figure_widget``) and ``timeline.py`` draws any recorded timeline as a Gantt chart.
"""

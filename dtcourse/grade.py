"""``python -m dtcourse.grade NOTEBOOK``: ``dtcourse grade`` (an instructor's grading, hidden checks too).

The grader itself is ``dtcourse.grading.grade``; this module keeps the command working.
"""

import sys

from dtcourse.grading.grade import main

if __name__ == "__main__":
    sys.exit(main())

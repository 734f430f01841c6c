"""``python -m dtcourse.grade NOTEBOOK``: the command students and the lessons use.

The grader itself is ``dtcourse.grading.grade``; this module keeps the command working.
"""

import sys

from dtcourse.grading.grade import main

if __name__ == "__main__":
    sys.exit(main())

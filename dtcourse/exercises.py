"""``python -m dtcourse.exercises [--check | --stub NAME]``: the command instructors and the Makefile use.

The generator itself is ``dtcourse.grading.exercises``; this module keeps the command working.
"""

import sys

from dtcourse.grading.exercises import main

if __name__ == "__main__":
    sys.exit(main())

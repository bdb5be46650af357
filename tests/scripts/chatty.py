"""Write LINES long lines to stdout and stderr as fast as possible (interleaving test)."""

import os
import sys

rank, lines = os.environ["RANK"], int(sys.argv[1])
for i in range(lines):
    body = f"{rank}-{i}-" + rank * 3000
    sys.stdout.write(body + "\n")
    sys.stderr.write(body + "\n")

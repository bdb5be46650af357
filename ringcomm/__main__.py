"""``python -m ringcomm ...``: the same as the ``ringcomm`` command."""

import sys

from ringcomm.cli import main

sys.exit(main())

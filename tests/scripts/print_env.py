"""Print the named environment variables as one JSON object: python print_env.py VAR..."""

import json
import os
import sys

print(json.dumps({name: os.environ.get(name) for name in sys.argv[1:]}))

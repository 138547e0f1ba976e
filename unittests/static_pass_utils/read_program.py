"""Prints the op list of a saved .pdmodel as JSON into OUT (for the CLI tests).

Usage: ``FLAGS_enable_pir_api=0 python unittests/static_pass_utils/read_program.py IN.pdmodel OUT.json``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from unittests.static_pass_utils.programs import op_list  # noqa: E402

from paddle.base.framework import Program  # noqa: E402

with open(sys.argv[1], "rb") as f:
    program = Program.parse_from_string(f.read())
with open(sys.argv[2], "w") as f:
    json.dump(op_list(program), f)

"""Puts the repository root first on ``sys.path``: the tests import ``paddle_graphpp`` and the
shared helpers of ``tools`` (``tools.launch``, ``tools.gpt_torch``, ...) from this checkout,
whichever way pytest was started."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

"""``python -m paddle_graphpp``: what paddle_graphpp will do on this machine (see :mod:`.report`)."""

import sys

from .report import main

sys.exit(main())

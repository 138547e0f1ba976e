"""The install lines the README documents, in one place: the skip messages of the tests that need
a package the README's test command does not install quote them, and
unittests/test_install_lines.py checks them against README.md, the requirements files and
.ci/run."""
import importlib.util

import pytest

TESTS = "pip install -e . -r requirements-test.txt && python -m pytest unittests"
# PaddleFormers installs without its declared dependencies: requirements-examples.txt says why.
PADDLEFORMERS = "pip install --no-deps paddleformers==1.2.0"
EXAMPLES = "pip install -e . -r requirements-examples.txt && " + PADDLEFORMERS


def skip_without_paddleformers(allow_module_level: bool = False) -> None:
    """Skip the calling test (or module) where PaddleFormers is not installed, quoting the line
    that installs it. Checked without importing it: importing paddleformers switches
    transformers' PyTorch support off for the whole process (it sets transformers'
    ``is_torch_available`` to False), which would break the PyTorch tests that run after."""
    if importlib.util.find_spec("paddleformers") is None:
        pytest.skip(f"paddleformers is not installed (the test command leaves it out): {PADDLEFORMERS}",
                    allow_module_level=allow_module_level)

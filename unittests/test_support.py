"""The supported version ranges (``paddle_graphpp.support``): a version below the oldest raises
with the range and the fix, a newer one than tested warns once, the installed frameworks pass."""
import subprocess
import sys
import warnings

import pytest

from paddle_graphpp import support
from paddle_graphpp.core.process import current_process
from paddle_graphpp.support import SUPPORTED, UnsupportedVersionError, VersionWarnings, require


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(current_process().part(VersionWarnings), "warned", set())


def test_every_integration_names_a_range_in_order():
    assert set(SUPPORTED) == {"torch", "paddle", "transformers", "paddleformers", "megatron-core"}
    for name, s in SUPPORTED.items():
        assert support._numeric(s.oldest) <= support._numeric(s.newest_tested), name


@pytest.mark.parametrize("version,bound,at_least,at_most", [
    ("5.24.0", "5.24", True, True), ("5.24.3", "5.24", True, True), ("5.3.0", "5.24", False, True),
    ("5.25.0", "5.24", True, False), ("2.13.0+cpu", "2.13", True, True), ("2.11.0a0+gitabc", "2.11", True, True),
    ("6.0.0rc1", "5.24", True, False), ("4.57.6", "5.0", False, True),
])
def test_versions_compare_by_their_leading_numbers(version, bound, at_least, at_most):
    assert support._at_least(version, bound) is at_least
    assert support._at_most(version, bound) is at_most


def test_an_older_version_raises_with_the_range_and_the_fix():
    with pytest.raises(UnsupportedVersionError, match=r"causal_lm_stage\(\).*transformers >= 5\.0 \(tested 5\.0 "
                                                      r"to 5\.25\); 4\.57\.6 is installed.*pip install"):
        require("transformers", "4.57.6")
    assert issubclass(UnsupportedVersionError, ImportError)


def test_a_newer_version_warns_once_and_goes_on():
    with pytest.warns(UserWarning, match=r"transformers 5\.30\.0 is newer than the newest version .* \(5\.25\)"):
        assert require("transformers", "5.30.0") == "5.30.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        require("transformers", "5.31.0")  # once per integration
        require("torch", "2.12.1")  # inside the range: silent


def test_source_builds_and_missing_packages_pass():
    assert require("paddle", "0.0.0") == "0.0.0"  # Paddle's develop builds
    assert require("megatron-core", None) in (None, support.installed_version("megatron-core"))


def test_the_installed_frameworks_are_in_range():
    rows = support.report()
    assert set(rows) == set(SUPPORTED)
    for name in ("torch", "paddle"):
        if rows[name]["installed"] is not None:
            assert rows[name]["status"] in ("supported", "untested (newer)"), rows[name]


def test_importing_the_module_imports_no_framework():
    code = ("import sys, paddle_graphpp.support as s; s.report(); "
            "print(sorted(m for m in ('torch', 'paddle', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_ci_tests_the_oldest_supported_transformers():
    import os
    import re
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".ci", "run")).read()
    pinned = re.findall(r"transformers==([\d.]+)", text)
    assert pinned and support._numeric(pinned[0])[:2] == support._numeric(SUPPORTED["transformers"].oldest)[:2]
    assert "--upgrade transformers" in text  # and the newest release on the index

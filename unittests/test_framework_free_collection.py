"""unittests/conftest.py reports a test module that cannot import torch or Paddle as skipped only
where the frameworks are absent on purpose (``PADDLE_GRAPHPP_FRAMEWORK_FREE=1``, set by .ci/run's
framework-free step); anywhere else the module is a collection error, so the suite cannot shrink
silently. Each case runs pytest in a subprocess over a copy of the conftest and one tiny module."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# the variable unittests/conftest.py reads (not imported: under a whole-suite run, the module named
# ``conftest`` may be unittests/gpu's)
FRAMEWORK_FREE_ENV = "PADDLE_GRAPHPP_FRAMEWORK_FREE"


def collect(tmp_path, missing: str, framework_free: bool) -> subprocess.CompletedProcess:
    """``pytest --collect-only`` over a module whose import fails as it does without ``missing``."""
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_needs_it.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{missing}'\", name={missing!r})\n\n\n"
        "def test_never_collected():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != FRAMEWORK_FREE_ENV}
    if framework_free:
        env[FRAMEWORK_FREE_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_the_variable_is_the_one_the_conftest_reads():
    with open(os.path.join(HERE, "conftest.py"), encoding="utf-8") as f:
        assert f'FRAMEWORK_FREE_ENV = "{FRAMEWORK_FREE_ENV}"' in f.read()


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_a_missing_framework_is_a_collection_error_by_default(tmp_path, framework):
    done = collect(tmp_path, framework, framework_free=False)
    assert done.returncode == 2, done.stdout + done.stderr  # interrupted: errors during collection
    assert f"No module named '{framework}'" in done.stdout and "1 error" in done.stdout, done.stdout


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_a_missing_framework_is_a_skip_in_the_framework_free_step(tmp_path, framework):
    done = collect(tmp_path, framework, framework_free=True)
    assert done.returncode in (0, 5), done.stdout + done.stderr  # nothing collected, nothing failed
    assert f"needs {framework}, which is not installed" in done.stdout and "error" not in done.stdout, done.stdout


def test_any_other_missing_module_is_a_collection_error_even_there(tmp_path):
    done = collect(tmp_path, "torchvision_extras", framework_free=True)
    assert done.returncode == 2 and "No module named 'torchvision_extras'" in done.stdout, done.stdout


def test_ci_sets_the_variable_in_its_framework_free_step_only():
    with open(os.path.join(os.path.dirname(HERE), ".ci", "run"), encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
    setting = [line for line in lines if f"{FRAMEWORK_FREE_ENV}=" in line]
    assert len(setting) == 2 and all('"$plain/bin/python" -m pytest' in line for line in setting), setting

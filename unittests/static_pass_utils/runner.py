"""Run a static_pass_utils script in a FLAGS_enable_pir_api=0 subprocess and load its JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def legacy_env(pir=False):
    """The environment of a Paddle subprocess: legacy static (PIR off before import) unless ``pir``."""
    return dict(os.environ, FLAGS_enable_pir_api="1" if pir else "0", PYTHONPATH=ROOT)


def run_script(name, out_json, *args, timeout=240, pir=False):
    """Run unittests/static_pass_utils/<name> with ``args`` and ``out_json``; return the JSON."""
    script = os.path.join(ROOT, "unittests", "static_pass_utils", name)
    proc = subprocess.run([sys.executable, script, *map(str, args), str(out_json)], cwd=ROOT,
                          env=legacy_env(pir), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{name} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out_json) as f:
        return json.load(f)

"""The send-wait command line on saved programs, and the pass's errors on bad input."""

import hashlib
import subprocess
import sys

import pytest
from static_pass_utils.runner import ROOT, legacy_env, run_script

pytest.importorskip("paddle")
pytestmark = pytest.mark.slow  # each case runs the command line in a fresh interpreter


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "static_passes.send_wait", *map(str, args)], cwd=ROOT,
                          env=env or legacy_env(), capture_output=True, text=True, timeout=120)


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    return d, run_script("save_programs.py", d / "ops.json", d)


def test_cli_rewrites_saved_program_and_leaves_input(saved, tmp_path):
    d, ops = saved
    before = digest(d / "section.pdmodel")
    out = tmp_path / "out.pdmodel"
    proc = cli(d / "section.pdmodel", "-o", out, "--startup", d / "startup.pdmodel")
    assert proc.returncode == 0, proc.stderr
    assert "removed c_sync_comm_stream #6 of send #4 ['fc_0.tmp_2'] ring 20" in proc.stdout
    assert "inserted nop #6 after recv #5" in proc.stdout and "127.0.0.1:6171" in proc.stdout
    assert digest(d / "section.pdmodel") == before
    written = run_script("read_program.py", tmp_path / "out.json", out)
    assert written == ops["upstream"]  # the same program upstream's own optimisation makes
    # idempotent on files too
    again = tmp_path / "again.pdmodel"
    proc = cli(out, "-o", again, "--startup", d / "startup.pdmodel")
    assert proc.returncode == 0 and "no change" in proc.stdout
    assert run_script("read_program.py", tmp_path / "again.json", again) == ops["upstream"]


def test_cli_without_startup_falls_back(saved, tmp_path):
    d, _ = saved
    proc = cli(d / "section.pdmodel", "-o", tmp_path / "o.pdmodel")
    assert proc.returncode == 0, proc.stderr
    assert "upstream's 1F1B rule" in proc.stdout


def test_cli_recognises_upstream_nop(saved, tmp_path):
    d, _ = saved
    proc = cli(d / "upstream.pdmodel", "-o", tmp_path / "o.pdmodel", "--startup", d / "startup.pdmodel")
    assert proc.returncode == 0, proc.stderr
    assert "no change" in proc.stdout and "existing nop #6 ['fc_0.tmp_2']" in proc.stdout


@pytest.mark.parametrize("content", [b"not a program \x00\x01\x02", b""])
def test_cli_corrupt_input_clear_error_input_untouched(tmp_path, content):
    bad = tmp_path / "bad.pdmodel"
    bad.write_bytes(content)
    out = tmp_path / "out.pdmodel"
    proc = cli(bad, "-o", out)
    assert proc.returncode == 2
    assert "static_passes.send_wait: error:" in proc.stderr and "bad.pdmodel" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert bad.read_bytes() == content and not out.exists()


def test_cli_refuses_to_overwrite_input(saved):
    d, _ = saved
    before = digest(d / "section.pdmodel")
    proc = cli(d / "section.pdmodel", "-o", d / "section.pdmodel")
    assert proc.returncode == 2 and "IN is never modified" in proc.stderr
    assert digest(d / "section.pdmodel") == before


def test_cli_missing_input(tmp_path):
    proc = cli(tmp_path / "nope.pdmodel", "-o", tmp_path / "o.pdmodel")
    assert proc.returncode == 2 and "cannot read the input program" in proc.stderr


@pytest.fixture(scope="module")
def pir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pir")
    return d, run_script("pir_inputs.py", d / "pir.json", d, pir=True)


def test_api_rejects_pir_program_and_non_program(pir):
    _, result = pir
    assert result["program_type"].endswith("pir.Program")
    assert result["pir"]["raised"] == "SendWaitError"
    assert "PIR pipeline programs hold no c_sync_comm_stream" in result["pir"]["message"]
    assert "FLAGS_enable_pir_api=0" in result["pir"]["message"]
    assert result["non_program"]["raised"] == "TypeError"
    assert "got builtins.str" in result["non_program"]["message"]


def test_cli_rejects_saved_pir_program(pir, tmp_path):
    d, result = pir
    assert "pir_model.json" in result["saved"]
    before = digest(d / "pir_model.json")
    proc = cli(d / "pir_model.json", "-o", tmp_path / "o.pdmodel")
    assert proc.returncode == 2 and "holds a PIR program" in proc.stderr
    assert digest(d / "pir_model.json") == before

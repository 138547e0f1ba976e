#!/usr/bin/env python
"""The GPU test suite in one process, recorded: ``python -m pytest unittests/gpu``, its exit code
and counts.

    python tools/gpu_suite.py                 # -> benchmarks/results/gpu-suite-<device>.json
    python tools/gpu_suite.py --name gpu-suite-2gpu    # on a 2-GPU machine: the 2-GPU tests too
    python tools/gpu_suite.py -- -m two_gpus            # the 2-GPU tests alone

Runs pytest once, in a child process, over the whole ``unittests/gpu`` folder (the way a user
runs it, so that every test file shares one interpreter and its teardown: the exit code is
part of what is checked), with a JUnit XML report for the counts. ``--probe`` checks after every
test that no allocation routing into a graph pool was left on (``GRAPHPP_PROBE_ALLOCATOR=1``, see
``unittests/gpu/conftest.py``): a test that leaves one errors or aborts the process right after it.

The record holds ``command``, ``exit_code``, ``passed``, ``failed`` (failures and errors),
``skipped``, ``gpus``, the environment (device, versions, date, code version), the failed
tests' names and the tail of the output.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, REPO)

from testing import launch  # noqa: E402
from tools import benchlib  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="gpu-suite", help="record name (the device is appended)")
    p.add_argument("--probe", action="store_true",
                   help="check after every test that no allocation routing into a graph pool was left on")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the whole suite")
    p.add_argument("pytest_args", nargs="*", help="more arguments for pytest (e.g. -k ...)")
    return p.parse_args(argv)


def counts(junit: Path) -> dict:
    """Passed, failed (failures and errors), skipped, and the failed tests' ids, from a JUnit
    report; with the seconds each test file took and the slowest tests (which a suite that must
    fit one device call would shorten first)."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "failed_tests": []}
    if not junit.exists():
        return out
    by_file: dict = {}
    times = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        seconds = float(case.get("time") or 0.0)
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        by_file[module] = by_file.get(module, 0.0) + seconds
        times.append((seconds, name))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            out["failed"] += 1
            out["failed_tests"].append({"test": name, "message": (bad.get("message") or "")[:1500]})
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    out["seconds_by_file"] = {k: round(v, 1) for k, v in sorted(by_file.items(), key=lambda kv: -kv[1])}
    out["slowest_tests"] = [[name, round(sec, 1)] for sec, name in sorted(times, reverse=True)[:10]]
    return out


def run_logged(cmd: list, env: dict, log: Path, timeout: float) -> tuple:
    """Run ``cmd`` in its own session with its output going to ``log`` as it is written;
    ``(exit code or None when stopped, a note for the output)``. A time limit or a SIGTERM of
    this process stops it (and what it started)."""
    with open(log, "w") as out, launch.sigterm_raises():
        proc = launch.start(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout), ""
        except subprocess.TimeoutExpired:
            return None, f"\n[timed out after {timeout:g} s]"
        except SystemExit:  # SIGTERM: stopped from outside (reproduce.py's budget)
            return None, "\n[stopped by SIGTERM]"
        finally:
            launch.stop(proc)


SESSION_END = re.compile(r"^=+ .*\b(passed|failed|error|errors|skipped)\b.* in [0-9.]+s")
OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def _verbose_lines(output: str):
    """``(test id, outcome or None)`` for each test line of pytest's ``-v`` output."""
    for line in output.splitlines():
        if line.startswith("unittests/gpu/") and "::" in line:
            words = line.split()
            yield words[0], next((w for w in words[1:] if w in OUTCOMES), None)


def counts_from_output(output: str) -> dict:
    """The counts from pytest's ``-v`` lines, for a run that ended before its JUnit report
    was written (a process that aborted in the middle)."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "failed_tests": []}
    for test, outcome in _verbose_lines(output):
        if outcome == "PASSED" or outcome == "XPASS":
            out["passed"] += 1
        elif outcome in ("FAILED", "ERROR"):
            out["failed"] += 1
            out["failed_tests"].append({"test": test, "message": "(see the output)"})
        elif outcome in ("SKIPPED", "XFAIL"):
            out["skipped"] += 1
    return out


def running_at_end(output: str) -> str | None:
    """The test the process died in: the last test before a fatal error (``-v`` prints a test's
    outcome before its teardown, so an abort there follows the outcome word), or a test that
    started and never ended; else None."""
    last, ended = None, True
    for line in output.splitlines():
        if line.startswith("unittests/gpu/") and "::" in line:
            words = line.split()
            last, ended = words[0], any(w in OUTCOMES for w in words[1:])
        elif SESSION_END.match(line):
            last, ended = None, True  # a fatal error after this is the interpreter's exit, no test's
        if "Fatal Python error" in line:
            return last
    return None if ended else last


def tail(output: str, chars: int = 6000) -> str:
    """The output's end without the interpreter's list of loaded extension modules (a fatal
    error prints it, thousands of characters that would push the error itself out of the tail)."""
    lines = [ln for ln in output.splitlines() if not ln.startswith("Extension modules:")]
    return "\n".join(lines)[-chars:]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp, "suite.xml")
        # -v: each test's id is printed as it starts, so an abort names the test it hit
        cmd = [sys.executable, "-m", "pytest", "unittests/gpu", "-v", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *args.pytest_args]
        env = dict(os.environ, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
        if args.probe:
            env["GRAPHPP_PROBE_ALLOCATOR"] = "1"
        # pytest writes to the log as it goes (beside the record under $OUT when set): a run
        # stopped from outside still leaves the tests it reached
        log = Path(os.environ["OUT"], f"{args.name}.log") if os.environ.get("OUT") else Path(tmp, "suite.log")
        code, note = run_logged(cmd, env, log, args.timeout)
        output = log.read_text(errors="replace") + note
        found = counts(junit) if junit.exists() else counts_from_output(output)
    command = shlex.join(["python", "-m", "pytest", "unittests/gpu", *args.pytest_args])
    record = {"command": command + (" (allocator probe)" if args.probe else ""),
              "exit_code": code, "passed": found["passed"], "failed": found["failed"],
              "skipped": found["skipped"], "gpus": torch.cuda.device_count(),
              "failed_tests": found["failed_tests"], "seconds_by_file": found.get("seconds_by_file"),
              "slowest_tests": found.get("slowest_tests"), "environment": benchlib.environment(),
              "code_version": benchlib.code_version(), "running_at_end": running_at_end(output),
              "output_tail": tail(output)}
    path = benchlib.write_result(args.name, record)
    print(f"exit code {code}: {found['passed']} passed, {found['failed']} failed, {found['skipped']} skipped "
          f"on {record['gpus']} GPU(s) -> {path}")
    print(tail(output, 3000))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

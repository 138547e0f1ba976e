"""benchmarks/: reproduce.py lists commands of tools that exist, and benchmarks/README.md indexes
every record under benchmarks/results, none of them named by iteration or session."""
import os
import re
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
ITERATION = re.compile(r"noret|first|second|third|fourth|fifth|sixth|after-|earlier|rounds\d|20\d\d-\d\d-\d\d")


def listed(*args) -> str:
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "reproduce.py"), "--list", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_listed_command_runs_a_tool_that_exists():
    lines = listed("--gpus", "4").splitlines()
    assert len(lines) >= 10
    for line in lines:
        tools = re.findall(r"\btools/\S+\.py\b", line)
        assert tools, f"no tool in {line!r}"
        for tool in tools:
            assert os.path.isfile(os.path.join(REPO, tool)), f"{tool} (listed in {line!r}) does not exist"


def test_the_gpu_count_selects_the_steps():
    one, two, four = (len(listed("--gpus", n).splitlines()) for n in ("1", "2", "4"))
    assert 0 < one < two < four
    assert len(listed("--only", "engine").splitlines()) == 1


def records() -> list:
    """Every file under benchmarks/results, as a path relative to it."""
    found = []
    for root, _, files in os.walk(RESULTS):
        found += [os.path.relpath(os.path.join(root, f), RESULTS) for f in files]
    return sorted(found)


def test_the_index_names_every_record():
    index = open(os.path.join(REPO, "benchmarks", "README.md"), encoding="utf-8").read()
    assert records()
    missing = [r for r in records() if f"`{os.path.basename(r)}`" not in index]
    assert not missing, f"benchmarks/README.md does not name {missing}"


def test_no_record_is_named_by_iteration():
    named = [r for r in records() if ITERATION.search(r)]
    assert not named, f"records named by iteration or session: {named}"


def test_every_record_the_index_names_exists():
    index = open(os.path.join(REPO, "benchmarks", "README.md"), encoding="utf-8").read()
    named = set(re.findall(r"`([\w.-]+\.(?:json|png))`", index))
    have = {os.path.basename(r) for r in records()}
    assert named <= have, f"benchmarks/README.md names records that do not exist: {sorted(named - have)}"


def test_a_written_record_says_which_code_and_command_measured_it(tmp_path, monkeypatch):
    import json

    from tools import benchlib

    monkeypatch.setattr(benchlib, "RESULTS", tmp_path)
    monkeypatch.setenv("GRAPHPP_CODE_VERSION", "abc123+dirty")
    monkeypatch.delenv("OUT", raising=False)
    path = benchlib.write_result("example", {"summary": {"x": 1.0}}, slug="h100")
    record = json.load(open(path))
    assert path.name == "example-h100.json"
    assert record["code_version"] == "abc123+dirty" and record["command"] and record["summary"] == {"x": 1.0}
    # a record that carries its own (a merge of parts measured elsewhere) keeps them
    kept = json.load(open(benchlib.write_result("example", {"command": "python x.py", "code_version": "def"},
                                                slug="h100")))
    assert kept["command"] == "python x.py" and kept["code_version"] == "def"


def test_without_git_a_record_names_the_code_by_a_digest_of_its_files(tmp_path, monkeypatch):
    import shutil

    from tools import benchlib

    for top in ("paddle_graphpp", "tools", "testing"):
        shutil.copytree(os.path.join(REPO, top), tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    assert benchlib.code_digest(tmp_path) == benchlib.code_digest(REPO)  # the same files: the same digest
    (tmp_path / "testing" / "launch.py").write_text((tmp_path / "testing" / "launch.py").read_text() + "\n# x\n")
    assert benchlib.code_digest(tmp_path) != benchlib.code_digest(REPO)  # the launcher the tools run counts
    shutil.copy(os.path.join(REPO, "testing", "launch.py"), tmp_path / "testing" / "launch.py")
    (tmp_path / "tools" / "benchlib.py").write_text((tmp_path / "tools" / "benchlib.py").read_text() + "\n# x\n")
    assert benchlib.code_digest(tmp_path) != benchlib.code_digest(REPO)
    monkeypatch.delenv("GRAPHPP_CODE_VERSION", raising=False)
    monkeypatch.setattr(benchlib, "ROOT", tmp_path)  # no .git there
    assert benchlib.code_version() == "files:" + benchlib.code_digest(tmp_path)


def test_named_steps_run_in_their_order_and_a_budget_skips_what_does_not_fit(tmp_path, monkeypatch):
    reproduce = _reproduce_module()
    assert [s[0] for s in reproduce.selected(1, "gpu-suite, engine")] == ["gpu-suite", "engine"]
    try:
        reproduce.selected(1, "engine,nope")
    except SystemExit as exc:
        assert "no step 'nope'" in str(exc)
    else:
        raise AssertionError("an unknown step was accepted")
    monkeypatch.setattr(reproduce, "gpu_count", lambda: 1)
    monkeypatch.setattr(reproduce, "STOP_GRACE_S", 0.5)
    monkeypatch.setattr(reproduce, "STEPS", [
        ("quick", 1, "python -c pass", "quick-<device>.json"),
        ("slow", 1, "python -c 'import time; time.sleep(60)'", "slow-<device>.json"),
        ("after", 1, "python -c pass", "after-<device>.json")])
    start = time.monotonic()
    code = reproduce.main(["--only", "quick,slow,after", "--budget", "4", "--log-dir", str(tmp_path)])
    assert code == 1 and time.monotonic() - start < 15  # the slow step stopped at the budget's end
    assert (tmp_path / "quick.log").exists() and (tmp_path / "slow.log").exists()
    assert not (tmp_path / "after.log").exists()  # skipped


def _reproduce_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("reproduce", os.path.join(REPO, "benchmarks", "reproduce.py"))
    reproduce = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reproduce)
    return reproduce


def test_lanes_run_side_by_side_each_on_its_own_gpus(tmp_path, monkeypatch):
    reproduce = _reproduce_module()
    monkeypatch.setattr(reproduce, "gpu_count", lambda: 4)
    monkeypatch.setattr(reproduce, "STEPS", [
        ("one", 1, "python -c \"import os,time; time.sleep(2); print('sees', os.environ['CUDA_VISIBLE_DEVICES'])\"",
         "one-<device>.json"),
        ("two", 2, "python -c \"import os,time; time.sleep(2); print('sees', os.environ['CUDA_VISIBLE_DEVICES'])\"",
         "two-<device>.json")])
    start = time.monotonic()
    code = reproduce.main(["--lanes", "0:one", "2,3:two", "--log-dir", str(tmp_path)])
    assert code == 0
    assert time.monotonic() - start < 3.9  # side by side, not 2 + 2 s one after the other
    assert "sees 0" in (tmp_path / "one.log").read_text()
    assert "sees 2,3" in (tmp_path / "two.log").read_text()


def test_without_lanes_each_step_sees_the_first_gpus_it_needs(tmp_path, monkeypatch):
    reproduce = _reproduce_module()
    monkeypatch.setattr(reproduce, "gpu_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    show = "python -c \"import os; print('sees', os.environ['CUDA_VISIBLE_DEVICES'])\""
    monkeypatch.setattr(reproduce, "STEPS", [("one", 1, show, "one-<device>.json"), ("two", 2, show, "two-<device>.json")])
    assert reproduce.main(["--gpus", "2", "--only", "one,two", "--log-dir", str(tmp_path)]) == 0
    assert "sees 0\n" in (tmp_path / "one.log").read_text()  # a 1-GPU suite does not run the 2-GPU tests
    assert "sees 0,1\n" in (tmp_path / "two.log").read_text()


def test_a_baseline_step_runs_the_same_command_from_the_older_checkout(tmp_path, monkeypatch):
    reproduce = _reproduce_module()
    old = tmp_path / "old"
    (old / "tools").mkdir(parents=True)
    (old / "CODE_VERSION").write_text("5f45ad6\n")
    monkeypatch.setattr(reproduce, "gpu_count", lambda: 1)
    monkeypatch.setattr(reproduce, "STEPS", [
        ("where", 1, "python -c \"import os; print('in', os.getcwd(), os.environ.get('GRAPHPP_CODE_VERSION'), "
                     "os.environ.get('PYTHONPATH', '').split(os.pathsep)[0])\"", "where-<device>.json")])
    logs = tmp_path / "logs"
    code = reproduce.main(["--baseline", str(old), "--only", "where,where@baseline", "--log-dir", str(logs)])
    assert code == 0
    assert f"in {old} 5f45ad6 {old}" in (logs / "where@baseline.log").read_text()
    assert f"in {reproduce.REPO} " in (logs / "where.log").read_text()
    with pytest.raises(SystemExit):  # a baseline step without a baseline checkout
        reproduce.main(["--only", "where@baseline", "--log-dir", str(logs)])


def test_lanes_are_refused_when_they_share_a_gpu_or_a_step_needs_more_than_its_lane(monkeypatch):
    reproduce = _reproduce_module()
    for specs, words in ((["0:engine", "0,1:allreduce"], "distinct"), (["5:engine"], "below this machine's 4"),
                         (["1:allreduce"], "need more GPUs"), (["engine"], "a colon")):
        try:
            reproduce.parse_lanes(specs, 4)
        except SystemExit as exc:
            assert words in str(exc), (specs, str(exc))
        else:
            raise AssertionError(f"lanes {specs} were accepted")


def test_the_gpu_suite_counts_a_run_that_aborted_and_names_the_test_it_died_in():
    from tools import gpu_suite

    output = "\n".join([
        "unittests/gpu/test_a.py::test_one PASSED                 [ 10%]",
        "unittests/gpu/test_a.py::test_two SKIPPED (needs 2 GPUs)  [ 20%]",
        "unittests/gpu/test_b.py::test_three FAILED               [ 30%]",
        "unittests/gpu/test_b.py::test_four ",
        "Fatal Python error: Aborted",
        "Extension modules: numpy, " + "x, " * 3000 + "torch (total: 3000)"])
    found = gpu_suite.counts_from_output(output)
    assert (found["passed"], found["skipped"], found["failed"]) == (1, 1, 1)
    assert found["failed_tests"][0]["test"] == "unittests/gpu/test_b.py::test_three"
    assert gpu_suite.running_at_end(output) == "unittests/gpu/test_b.py::test_four"
    # ended, then the process died (in its teardown, or at exit): the last test is named
    assert gpu_suite.running_at_end(output.replace("test_four ", "test_four PASSED")) == "unittests/gpu/test_b.py::test_four"
    assert gpu_suite.running_at_end(output.replace("test_four ", "test_four PASSED").split("Fatal")[0]) is None
    assert "Fatal Python error: Aborted" in gpu_suite.tail(output, 200)  # the module list is left out
    # an abort in a test's teardown follows its outcome word on the same line (-v)
    torn = "unittests/gpu/test_a.py::test_one PASSED [ 50%]Fatal Python error: Aborted\nExtension modules: x"
    assert gpu_suite.running_at_end(torn) == "unittests/gpu/test_a.py::test_one"
    at_exit = "unittests/gpu/test_a.py::test_one PASSED [100%]\n==== 1 passed in 3.20s ====\nFatal Python error: Aborted"
    assert gpu_suite.running_at_end(at_exit) is None  # the interpreter's exit, after every test


def test_the_gpu_suite_record_says_where_the_time_went(tmp_path):
    from tools import gpu_suite

    junit = tmp_path / "suite.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="unittests.gpu.test_pipeline_gpu" name="test_a" time="41.5"/>'
        '<testcase classname="unittests.gpu.test_pipeline_gpu" name="test_b" time="20.0"><failure message="x"/></testcase>'
        '<testcase classname="unittests.gpu.test_engine_gpu" name="test_c" time="3.25"><skipped/></testcase>'
        '</testsuite></testsuites>')
    found = gpu_suite.counts(junit)
    assert (found["passed"], found["failed"], found["skipped"]) == (1, 1, 1)
    assert found["seconds_by_file"] == {"test_pipeline_gpu": 61.5, "test_engine_gpu": 3.2}
    assert found["slowest_tests"][0] == ["unittests.gpu.test_pipeline_gpu::test_a", 41.5]


def test_the_gpu_suite_logs_as_it_goes_so_a_stopped_run_keeps_what_it_reached(tmp_path):
    import sys

    from tools import gpu_suite

    log = tmp_path / "suite.log"
    cmd = [sys.executable, "-c", "import time; print('unittests/gpu/test_a.py::test_one PASSED', flush=True); "
                                 "print('unittests/gpu/test_a.py::test_two ', flush=True); time.sleep(60)"]
    start = time.monotonic()
    code, note = gpu_suite.run_logged(cmd, dict(os.environ), log, timeout=3)
    assert code is None and "timed out after 3 s" in note and time.monotonic() - start < 30
    output = log.read_text()
    assert gpu_suite.counts_from_output(output)["passed"] == 1
    assert gpu_suite.running_at_end(output) == "unittests/gpu/test_a.py::test_two"


@pytest.mark.parametrize("lanes", [False, True])
def test_a_sigterm_stops_the_running_steps_and_starts_no_more(tmp_path, lanes):
    """A SIGTERM of reproduce.py (a device call's time limit): the steps running then are
    stopped, with their process groups, and the steps after them in each lane never start."""
    import signal
    import subprocess
    import sys
    import textwrap

    marker = tmp_path / "marks"
    marker.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("reproduce", {os.path.join(REPO, "benchmarks", "reproduce.py")!r})
        reproduce = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(reproduce)
        reproduce.gpu_count = lambda: 4
        reproduce.STOP_GRACE_S = 2.0
        slow = "python -c \\"import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(60)\\" "
        reproduce.STEPS = [(n, 1, slow + {str(marker)!r} + "/" + n, n + "-<device>.json") for n in ("a1", "a2", "b1", "b2")]
        args = ["--lanes", "0:a1,a2", "1:b1,b2"] if {lanes} else ["--only", "a1,a2"]
        sys.exit(reproduce.main(args + ["--log-dir", {str(tmp_path)!r}]))
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], start_new_session=True)
    first = ["a1", "b1"] if lanes else ["a1"]
    deadline = time.monotonic() + 30
    while not all((marker / n).exists() for n in first) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all((marker / n).exists() for n in first), "the first steps did not start"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    time.sleep(3)  # what would start after the signal has had time to
    assert not (marker / "a2").exists() and not (marker / "b2").exists()
    out = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True)
    assert out.stdout.strip() == "", f"steps left running: {out.stdout}"


def test_a_steps_settings_before_its_command_go_into_its_environment(tmp_path, monkeypatch):
    reproduce = _reproduce_module()
    monkeypatch.setattr(reproduce, "gpu_count", lambda: 1)
    monkeypatch.setattr(reproduce, "STEPS", [
        ("flagged", 1, "FLAGS_graphpp_pool_expandable=0 OTHER=a=b python -c \"import os; "
                       "print('got', os.environ['FLAGS_graphpp_pool_expandable'], os.environ['OTHER'])\"",
         "flagged-<device>.json")])
    code = reproduce.main(["--only", "flagged", "--log-dir", str(tmp_path)])
    assert code == 0
    assert "got 0 a=b" in (tmp_path / "flagged.log").read_text()


def test_the_run_says_at_once_what_it_runs_and_a_running_step_reports_its_time(tmp_path, monkeypatch, capsys):
    reproduce = _reproduce_module()
    monkeypatch.setattr(reproduce, "gpu_count", lambda: 1)
    monkeypatch.setattr(reproduce, "PROGRESS_S", 0.5)
    monkeypatch.setattr(reproduce, "STEPS", [
        ("busy", 1, "python -c \"import time; print('warming up', flush=True); time.sleep(2.5)\"", "busy-<device>.json")])
    assert reproduce.main(["--only", "busy", "--log-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("reproduce.py: 1 step(s): busy; logs in "), lines
    assert lines[1].startswith("[1/1] busy (run 0 s): python -c"), lines
    progress = [line for line in lines if line.startswith("    busy: ") and " s (run " in line]
    assert len(progress) >= 2 and progress[-1].endswith(": warming up"), lines

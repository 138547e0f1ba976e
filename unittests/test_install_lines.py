"""The install lines the README documents (unittests/installs.py) hold together: the README
states them, .ci/run runs the test command verbatim before any other suite step, the test
requirements include the examples', and every module the README's examples import comes from a
distribution that the examples' line installs. (That the examples then run is
unittests/test_readme_examples.py.)"""
import ast
import importlib.metadata
import os
import re
import sys

import pytest

import installs
from paddle_graphpp.support import SUPPORTED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# import name -> distribution, for a module that is not installed here (the metadata says it otherwise)
NOT_INSTALLED_DISTRIBUTION = {"paddle": "paddlepaddle"}


def read(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return f.read()


def requirement_names(name: str) -> set:
    """The distribution names a requirements file lists (following ``-r``), normalised."""
    names = set()
    for line in read(name).splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            names |= requirement_names(line[3:].strip())
        elif line and not line.startswith("-"):
            names.add(normalise(re.match(r"[A-Za-z0-9._-]+", line).group(0)))
    return names


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_readme_states_the_test_command_and_the_examples_line():
    readme = read("README.md")
    assert f"\n{installs.TESTS}\n" in readme
    examples = readme[readme.index("## Using it with your model"):]
    assert f"`{installs.EXAMPLES}`" in examples[:examples.index("\n## ", 5)]
    assert installs.EXAMPLES in read("requirements-examples.txt")


def suite_lines() -> list:
    """.ci/run's command lines, comments left out."""
    return [line.strip() for line in read(".ci/run").splitlines() if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_the_readme_test_command_verbatim_before_any_other_suite_step():
    lines = suite_lines()
    assert installs.TESTS in lines
    first = lines.index(installs.TESTS)
    assert not any("pytest" in line or "pip install" in line for line in lines[:first]), lines[:first]
    assert any(installs.PADDLEFORMERS in line for line in lines[first + 1:])  # for the tests the command skips


def test_ci_runs_every_test_module_that_needs_paddleformers_while_it_is_installed():
    """A module that skips without PaddleFormers (the README's test command leaves it out) runs in
    .ci/run's PaddleFormers step, or its tests would never run anywhere."""
    script = read(".ci/run")
    start = script.index(installs.PADDLEFORMERS, script.index(installs.TESTS))
    step = script[start:script.index("uninstall -q -y paddleformers", start)]
    ran = set(re.findall(r"unittests/[\w/]+\.py", step))
    needing = {f"unittests/{name}" for name in os.listdir(os.path.join(REPO, "unittests"))
               if name.startswith("test_") and name.endswith(".py")
               and re.search(r"^\s*(installs\.)?skip_without_paddleformers\(", read(f"unittests/{name}"), re.M)}
    assert needing, "no test module needs PaddleFormers: the check would prove nothing"
    assert needing <= ran, f"not run with PaddleFormers installed by .ci/run: {sorted(needing - ran)}"


def test_the_test_requirements_include_the_examples_and_pin_both_frameworks():
    assert "-r requirements-examples.txt" in read("requirements-test.txt").splitlines()
    assert {"paddlepaddle", "torch", "transformers"} <= requirement_names("requirements-examples.txt")
    assert "paddleformers" not in requirement_names("requirements-test.txt")  # installed --no-deps, apart


def imported_modules(code: str) -> set:
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules


def distribution_of(module: str) -> str:
    found = importlib.metadata.packages_distributions().get(module)
    return normalise(found[0] if found else NOT_INSTALLED_DISTRIBUTION.get(module, module))


def test_every_module_the_readme_examples_import_comes_from_the_examples_line():
    from test_readme_examples import examples

    listed = requirement_names("requirements-examples.txt") | {"paddleformers", "paddle-graphpp"}
    listed |= {"numpy"}  # paddle_graphpp's own dependency (setup.py), which `-e .` installs
    missing = {}
    for name, (_command, code) in examples().items():
        for module in imported_modules(code) - set(sys.stdlib_module_names):
            if distribution_of(module) not in listed:
                missing.setdefault(name, []).append(module)
    assert not missing, f"the README's examples import modules requirements-examples.txt does not install: {missing}"


def test_the_examples_line_checks_its_own_packages_and_the_check_can_fail():
    assert imported_modules("import os\nfrom paddle.distributed import fleet\nimport datasets.x\n") == \
        {"os", "paddle", "datasets"}
    assert "datasets" not in requirement_names("requirements-examples.txt")


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_the_readme_table_names_the_newest_tested_version(name):
    """Each row of the README's supported-versions table names the version support.py records as
    the newest tested, so the two cannot drift apart."""
    rows = {row.split("|")[1].strip().lower(): row for row in read("README.md").splitlines() if row.startswith("| ")}
    label = {"torch": "pytorch"}.get(name, SUPPORTED[name].distribution)
    assert label in rows, f"the README's supported table has no row for {label}"
    tested = rows[label].split("|")[3]
    assert re.search(rf"(?<![\d.]){re.escape(SUPPORTED[name].newest_tested)}(?![\d])", tested), (label, tested)

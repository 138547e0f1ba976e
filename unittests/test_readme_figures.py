"""The README's Measured table states only figures its records hold: every ratio in a row (``4.63×``,
``1.10–1.86×``, both ends of a range) is found, rounded to the digits the README gives, among the
numbers of the JSON records that row links (benchmarks/results/). A figure from a session that left
no record, or an earlier run's, fails here."""
import json
import math
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Measured"
# a ratio, or a range of them, followed by the multiplication sign: 4.63×, 1.10–1.86×, 0.98-1.03×
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:\s*[–-]\s*(\d+(?:\.\d+)?))?\s*×")
RECORD_LINK = re.compile(r"\]\((benchmarks/results/[\w.-]+\.json)\)")


def measured_rows() -> list:
    """``(what, measured, [record paths])`` of each row of the README's Measured table."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    start = text.index(SECTION + "\n")
    section = text[start:text.find("\n## ", start + len(SECTION))]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("what", "") or set(cells[0]) <= {"-"}:
            continue
        rows.append((cells[0], cells[1], RECORD_LINK.findall(cells[2])))
    return rows


def stated(measured: str) -> list:
    """The ratios a cell states, as the strings it writes them (both ends of each range)."""
    found = []
    for low, high in RATIO.findall(measured.replace("**", "")):
        found += [low] + ([high] if high else [])
    return found


def numbers(value) -> list:
    """Every number in a parsed JSON record (strings included: notes write figures as text)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)] if math.isfinite(value) else []
    if isinstance(value, str):
        return [float(x) for x in re.findall(r"\d+\.\d+|\d+", value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return []


def holds(figure: str, values: list) -> bool:
    """Whether one of ``values``, rounded to the digits ``figure`` shows, is ``figure``."""
    digits = len(figure.partition(".")[2])
    want = float(figure)
    return any(abs(v - want) <= 0.5 * 10 ** -digits + 1e-9 for v in values)


def test_the_table_has_rows_each_linking_a_record():
    rows = measured_rows()
    assert len(rows) >= 10
    for what, _, records in rows:
        assert records, f"the Measured row {what!r} links no record under benchmarks/results/"


@pytest.mark.parametrize("what,measured,records", measured_rows(), ids=[r[0] for r in measured_rows()])
def test_every_figure_of_a_row_is_in_its_records(what, measured, records):
    values = []
    for path in records:
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            values += numbers(json.load(f))
    figures = stated(measured)
    assert figures, f"no figure found in {measured!r}"
    missing = [figure for figure in figures if not holds(figure, values)]
    assert not missing, f"{what}: {missing}× are in none of {records}"


def test_the_check_finds_a_figure_that_no_record_holds():
    assert stated("plain loop 4.23×, **1.10–1.86×** eager, seq 512, 4 ranks") == ["4.23", "1.10", "1.86"]
    assert holds("4.24", [4.239689740832834]) and holds("1.017", [1.0166])
    assert not holds("4.73", [4.239689740832834, 2.9654528711349135])

"""The README's figures are the committed results': every number in the headline table is
in the RESULTS file its row cites (and the machine it names is that file's), and every
figure of the fleet section is in the RESULTS files that section cites.  A benchmark rerun
that moves a figure fails here until the README says the new one."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

# a figure: a number with a decimal point, a percentage, or 3+ digits (small integers --
# "2 instances", "8 x 4k" -- are the setting, not the result)
FIGURE = re.compile(r"(?<![\w.])[+-]?(\d+\.\d+|\d+%|\d{3,})(?![\w.]*\d)")
MACHINE_WORDS = ("intel", "xeon", "amd", "epyc", "zen 5", "zen 2", "avx512", "avx2", "amx",
                 "x86_64", "bf16")


def _readme() -> str:
    return open(README, encoding="utf-8").read()


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md: no section {title!r}"
    return m.group(1)


def _prose(section: str) -> str:
    """The section without its code blocks (ports, core lists) and link targets."""
    out = re.sub(r"^```.*?^```", "", section, flags=re.M | re.S)
    return re.sub(r"\]\([^)]*\)", "]", out)


def _figures(text: str) -> list[str]:
    return [m.group(1) for m in FIGURE.finditer(text)]


def _source(name: str) -> str:
    path = os.path.join(ROOT, "benchmarks", os.path.basename(name))
    assert os.path.exists(path), f"README cites {name}, which does not exist"
    return open(path, encoding="utf-8").read()


def _norm(s: str) -> str:
    return s.lower().replace("-", "").replace("avx 512", "avx512")


def _headline_rows():
    rows = []
    for line in _section(_readme(), "Headline figures").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("what", "---") or set(cells[0]) <= set("-"):
            continue
        m = re.search(r"\]\((benchmarks/RESULTS[\w]*\.md)\)", cells[3])
        assert m, f"README headline row without a RESULTS source: {line}"
        rows.append((cells[0], cells[1], cells[2], m.group(1)))
    assert len(rows) >= 6, rows
    return rows


@pytest.mark.parametrize("what, figure, machine, source", _headline_rows(),
                         ids=lambda x: x[:40] if isinstance(x, str) else None)
def test_headline_figure_is_in_its_results(what, figure, machine, source):
    text = _source(source)
    figures = _figures(figure)
    assert figures, f"{what!r}: no figure in {figure!r}"
    missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", text)]
    assert not missing, f"{what!r}: {missing} not in {source}"
    norm = _norm(text)
    named = [w for w in MACHINE_WORDS if w in _norm(machine)]
    assert named, f"{what!r}: the machine {machine!r} names no CPU or ISA"
    absent = [w for w in named if w not in norm]
    assert not absent, f"{what!r}: machine words {absent} not in {source}"


def test_fleet_figures_are_in_the_results_it_cites():
    sec = _section(_readme(), "Serving a fleet")
    cited = sorted(set(re.findall(r"RESULTS_\w+\.md", sec)))
    assert cited, "the fleet section cites no RESULTS file"
    texts = "\n".join(_source(c) for c in cited)
    figures = _figures(_prose(sec))
    assert len(figures) >= 10, figures
    missing = [f for f in figures
               if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", texts)]
    assert not missing, f"fleet figures not in {cited}: {missing}"


def test_a_wrong_figure_is_caught(tmp_path):
    """The check can fail: a figure the results do not hold is reported."""
    figures = _figures("4.61-5.22 ms, 18.3-30.2x")
    text = _source("RESULTS_attention.md")
    missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", text)]
    assert missing == ["4.61"]

"""The repository stands alone: its promises are written in ``docs/``, and everything that
points at them arrives.

- No file cites a document the repository does not hold: a product "contract" or its
  "section N". Code and docs name the page and heading instead, e.g. ``(docs/calibration.md,
  "Order")`` in a comment, a relative link in markdown.
- Every relative link of the README and the docs pages reaches a file, and a heading of it
  when the link names one (GitHub's anchors).
- Every ``docs/<page>.md, "<Heading>"`` (or ``docs/<page>.md#anchor``) citation in the code
  names a page that exists and a heading it has; every ``docs/<page>.md`` named exists.
- Every docs page can be reached from the README by following links.
- The README's quoted ``make demo`` lines are what the Makefile's demo command prints
  (counts and accuracies; not the seconds, which follow the machine).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()
SKIPPED_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", ".bnrecal"}
MARKDOWN_PAGES = ("README.md", "deploy/README.md")

# A citation of an outside document: the word "contract" (not inside an identifier such as
# a function name) or "section N".
OUTSIDE_CITATION = re.compile(r"\bcontracts?\b|CONTRACT\.md|\bsections? \d+", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# (docs/page.md, "Heading") or docs/page.md ("Heading"), possibly wrapped over comment lines.
CODE_CITATION = re.compile(r"docs/([\w.-]+\.md)(?:,\s*|\s*\(\s*)\"([^\"]+)\"")
PAGE_MENTION = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)")
ANCHORED_MENTION = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)#([\w-]+)")


def tracked_files() -> list[str]:
    """The repository's files as git tracks them; a walk of the tree where there is no git."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        names = [name for name in listing.split("\0") if name]
        if names:
            return [name for name in names if (ROOT / name).is_file()]
    except (OSError, subprocess.SubprocessError):
        pass
    return sorted(
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*")
        if path.is_file() and not SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts)
    )


def text_of(name: str) -> str | None:
    """The file's text, or None for a binary file (an image)."""
    data = (ROOT / name).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a markdown text outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed,
    spaces as hyphens (``Checks and the report's `int8` section`` ->
    ``checks-and-the-reports-int8-section``)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    kept = "".join(
        ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in ("L", "N")
    )
    return kept.replace(" ", "-")


def headings(page: Path) -> list[str]:
    """The headings of a markdown page, as written (code blocks skipped)."""
    found = []
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            found.append(match.group(2))
    return found


def anchors(page: Path) -> set[str]:
    """Every anchor of a page; a repeated heading's later anchors get ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(page):
        anchor = github_anchor(heading)
        if anchor in seen:
            seen[anchor] += 1
            result.add(f"{anchor}-{seen[anchor]}")
        else:
            seen[anchor] = 0
            result.add(anchor)
    return result


def markdown_pages() -> list[str]:
    """The README, the deployment guide and every page under docs/."""
    docs = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))
    return [*MARKDOWN_PAGES, *docs]


def relative_links(page: str) -> Iterator[tuple[int, str]]:
    """(line, target) of every link of a page that is not to another site."""
    for number, line in prose_lines((ROOT / page).read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("``", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                yield number, target


def broken_link(page: str, target: str) -> str | None:
    """Why a relative link of ``page`` leads nowhere, or None when it arrives."""
    path_part, _, anchor = target.partition("#")
    destination = (ROOT / page).parent / path_part if path_part else ROOT / page
    destination = destination.resolve()
    if not destination.exists():
        return f"{path_part} does not exist"
    if anchor and destination.suffix == ".md" and anchor not in anchors(destination):
        return f"{destination.relative_to(ROOT).as_posix()} has no heading with anchor #{anchor}"
    return None


def test_no_file_cites_an_outside_contract() -> None:
    offenders = []
    for name in tracked_files():
        if name == THIS_FILE:
            continue
        text = text_of(name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if OUTSIDE_CITATION.search(line):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert not offenders, (
        "these lines cite a document the repository does not hold; write the promise in the "
        "docs/ page it belongs to and cite that page and heading, e.g. (docs/calibration.md, "
        '"Order"):\n' + "\n".join(offenders)
    )


def test_relative_links_of_the_docs_arrive() -> None:
    broken = []
    for page in markdown_pages():
        for number, target in relative_links(page):
            why = broken_link(page, target)
            if why:
                broken.append(f"{page}:{number}: ({target}): {why}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_code_cites_pages_and_headings_that_exist() -> None:
    wrong = []
    for name in tracked_files():
        if name.endswith(".md") or name == THIS_FILE:
            continue
        text = text_of(name)
        if text is None:
            continue
        joined = re.sub(r"\s*\n\s*(?:#+\s*)?", " ", text)  # citations wrapped over comment lines
        for page in sorted(set(PAGE_MENTION.findall(text))):
            if not (ROOT / "docs" / page).is_file():
                wrong.append(f"{name}: docs/{page} does not exist")
        for page, anchor in ANCHORED_MENTION.findall(text):
            path = ROOT / "docs" / page
            if path.is_file() and anchor not in anchors(path):
                wrong.append(f"{name}: docs/{page} has no heading with anchor #{anchor}")
        for page, heading in CODE_CITATION.findall(joined):
            path = ROOT / "docs" / page
            if path.is_file() and heading not in headings(path):
                wrong.append(f'{name}: docs/{page} has no heading "{heading}"')
    assert not wrong, "citations of docs/ that lead nowhere:\n" + "\n".join(wrong)


def test_every_docs_page_is_reached_from_the_readme() -> None:
    reached = {"README.md"}
    frontier = ["README.md"]
    while frontier:
        page = frontier.pop()
        for _, target in relative_links(page):
            path_part = target.partition("#")[0]
            if not path_part.endswith(".md"):
                continue
            destination = ((ROOT / page).parent / path_part).resolve()
            if destination.is_file() and ROOT in destination.parents:
                linked = destination.relative_to(ROOT).as_posix()
                if linked not in reached:
                    reached.add(linked)
                    frontier.append(linked)
    unreached = [page for page in markdown_pages() if page not in reached]
    assert not unreached, f"docs pages no link from the README leads to: {unreached}"


def test_github_anchors_of_known_headings() -> None:
    """The anchor rule the link check relies on, on headings of this repository's pages."""
    assert github_anchor("Checks and the report's `int8` section") == "checks-and-the-reports-int8-section"
    assert github_anchor("torch.export programs") == "torchexport-programs"
    assert github_anchor("From Python: `bnrecal.recalibrate`") == "from-python-bnrecalrecalibrate"
    assert github_anchor("One worker, no Ray") == "one-worker-no-ray"
    assert github_anchor("1. Build and push the image") == "1-build-and-push-the-image"


DEMO_BLOCK = re.compile(r"^## What it does for a model$.*?^```text\n(.*?)^```", re.M | re.S)
TIMES = re.compile(r"\b\d+(?:\.\d+)? (?:s|ms)\b")  # the machine's, not the demo's
CPU = re.compile(r"measured on .*$")  # the machine's CPU and its INT8 flags, not the demo's
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def demo_command() -> list[str]:
    """The arguments of the ``bnrecal calibrate`` in the Makefile's ``demo`` recipe."""
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    line = next(line for line in re.sub(r"\\\n\s*", " ", recipe).splitlines() if "bnrecal calibrate" in line)
    args = shlex.split(line)
    return args[args.index("calibrate"):]


# The stale model is trained where the demo runs, and its figures follow the machine's float
# rounding (top-1 0.35 to 0.46 on this project's machines): they and what derives from them
# are not compared.
STALE = [
    (re.compile(r"\d+\.\d+(?= -> )"), "<stale>"),
    (re.compile(r"stale INT8 \d+\.\d+"), "stale INT8 <stale>"),
    (re.compile(r"\d+\.\d+% of predictions changed"), "<stale>% of predictions changed"),
    (re.compile(r"\(drop -?\d+\.\d+ points\)"), "(drop <stale> points)"),
]


def comparable(line: str) -> str:
    """A summary line with its times and the stale model's figures masked."""
    line = CPU.sub("measured on <cpu>", TIMES.sub("<time>", line))
    for pattern, mask in STALE:
        line = pattern.sub(mask, line)
    return line


def numbers_agree(quoted: str, printed: str) -> bool:
    """Counts equal; decimals (the recalibrated model's accuracies, sizes, standard errors)
    within a machine's drift: 0.03 for fractions, 10% for the rest."""
    a, b = float(quoted.replace(",", "")), float(printed.replace(",", ""))
    if "." not in quoted:
        return a == b
    return abs(a - b) <= (0.03 if max(a, b) <= 1 else 0.1 * max(a, b))


@pytest.mark.usefixtures("ray_cluster")
def test_the_readme_quotes_what_make_demo_prints(demo_inputs, capsys) -> None:
    from tests.conftest import run_cli

    folder = demo_inputs.checkpoint.parent
    code, out, err = run_cli(capsys, *[arg.replace("demo/", f"{folder}/") for arg in demo_command()])
    assert code == 0, err
    printed = [comparable(line.replace(f"{folder}/", "demo/")) for line in (out + err).splitlines()]
    quoted = [comparable(line) for line in DEMO_BLOCK.search(README).group(1).splitlines()]
    assert quoted, "the README quotes no demo lines"
    tail = printed[-len(quoted):]
    for want, got in zip(quoted, tail):
        assert NUMBER.sub("#", want) == NUMBER.sub("#", got), f"README: {want}\nmake demo: {got}"
        pairs = list(zip(NUMBER.findall(want), NUMBER.findall(got)))
        assert all(numbers_agree(a, b) for a, b in pairs), f"README: {want}\nmake demo: {got}"


README = (ROOT / "README.md").read_text(encoding="utf-8")

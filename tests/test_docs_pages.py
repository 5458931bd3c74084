"""The user's pages (README.md, docs/*.md and benchmarks/README.md) hold together: every code block says what the
tests do with it, Python blocks compile, names and paths in code exist, links and anchors resolve,
and the README stays a page for users.

How a page marks its blocks is said in docs/development.md ("Checking the docs"):
``<!-- docs: run; expect "..." -->``, ``<!-- docs: file NAME -->`` or ``<!-- docs: shown: WHY -->`` on
the line before each ``bash`` or ``python`` block. tests/test_docs_commands.py runs the ``run`` blocks.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import pathlib
import re
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
# Pages whose links are checked too, though their blocks are not (the benchmarks' detail pages).
LINKED_PAGES = sorted({*PAGES, *(ROOT / "benchmarks").glob("*.md")})
README_MAX_LINES = 350
CHECKED_LANGUAGES = {"bash", "sh", "shell", "console", "python", "py"}
RUNNABLE_LANGUAGES = {"bash", "python"}
DEFAULT_TIMEOUT_S = 120


@dataclasses.dataclass
class Marker:
    kind: str  # run | file | shown
    expect: list[str] = dataclasses.field(default_factory=list)
    timeout_s: int = DEFAULT_TIMEOUT_S
    exit_status: int = 0
    slow: bool = False
    name: str = ""  # file: the file's name
    reason: str = ""  # shown: why it is not run


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marker: Marker | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


MARKER_LINE = re.compile(r"^\s*<!--\s*docs:(.*?)-->\s*$")
RUN_OPTION = re.compile(r'\s*(?:expect\s+"((?:[^"\\]|\\.)*)"|(timeout|exit)\s+(\d+)|(slow))\s*(?:;|$)')


def parse_marker(text: str, where: str) -> Marker:
    """The comment's text after ``docs:``; a ValueError names what is wrong and where."""
    text = text.strip()
    if text.startswith("shown:"):
        reason = text[len("shown:"):].strip()
        if not reason:
            raise ValueError(f"{where}: 'docs: shown:' needs a reason (what the block needs, which test covers it)")
        return Marker("shown", reason=reason)
    if text.startswith("file "):
        name = text[len("file "):].strip()
        if not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(f"{where}: 'docs: file {name}': expected a plain file name")
        return Marker("file", name=name)
    if text == "run" or text.startswith("run;"):
        marker, rest, pos = Marker("run"), text[len("run"):].lstrip(";"), 0
        while pos < len(rest):
            match = RUN_OPTION.match(rest, pos)
            if not match:
                raise ValueError(f"{where}: 'docs: {text}': cannot read the options from {rest[pos:]!r}; expected "
                                 "expect \"TEXT\", timeout N, exit N or slow, separated by ';'")
            if match.group(1) is not None:
                marker.expect.append(match.group(1).replace('\\"', '"'))
            elif match.group(2) == "timeout":
                marker.timeout_s = int(match.group(3))
            elif match.group(2) == "exit":
                marker.exit_status = int(match.group(3))
            else:
                marker.slow = True
            pos = match.end()
        return marker
    raise ValueError(f"{where}: 'docs: {text}': expected 'run[; options]', 'file NAME' or 'shown: WHY'")


def read_blocks(page: pathlib.Path) -> list[Block]:
    """Every fenced block of the page, with the marker on the line before it (if any)."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,}|~{3,})(.*)$", lines[i])
        if not opening:
            if MARKER_LINE.match(lines[i]) and not (i + 1 < len(lines) and re.match(r"^\s*(```|~~~)", lines[i + 1])):
                raise ValueError(f"{page.relative_to(ROOT)}:{i + 1}: a docs marker must be on the line just before "
                                 "a fenced block")
            i += 1
            continue
        indent, fence, info = opening.groups()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        where = f"{page.relative_to(ROOT)}:{i + 1}"
        previous = MARKER_LINE.match(lines[i - 1]) if i > 0 else None
        marker = parse_marker(previous.group(1), where) if previous else None
        language = info.split()[0].lower() if info.split() else ""
        blocks.append(Block(page, i + 1, language, "\n".join(body) + "\n", marker))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in read_blocks(page)]


def prose(page: pathlib.Path) -> str:
    """The page without its fenced blocks (blanked line for line, so line numbers stay)."""
    out, fence = [], ""
    for line in page.read_text().splitlines():
        opening = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence:
            if opening and opening.group(1).startswith(fence):
                fence = ""
            out.append("")
        elif opening:
            fence = opening.group(1)
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def code_texts(page: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span and every fenced block of the page."""
    found = [(block.line, block.text) for block in read_blocks(page)]
    for number, line in enumerate(prose(page).splitlines(), 1):
        found += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
    return found


# --- the blocks -------------------------------------------------------------------------------------


def test_every_code_block_says_what_the_test_does_with_it() -> None:
    problems = []
    for block in all_blocks():
        if block.language not in CHECKED_LANGUAGES:
            continue
        if block.marker is None:
            problems.append(f"{block.where}: a {block.language} block without a marker on the line before it: "
                            "<!-- docs: run -->, <!-- docs: file NAME --> or <!-- docs: shown: WHY --> "
                            "(docs/development.md, \"Checking the docs\")")
        elif block.marker.kind == "run" and block.language not in RUNNABLE_LANGUAGES:
            problems.append(f"{block.where}: only bash and python blocks run, not {block.language}")
    assert not problems, "\n".join(problems)


def test_the_run_blocks_are_run_somewhere() -> None:
    """The README runs its example, and the pages run commands: a docs test with nothing to run checks nothing."""
    runs = [b for b in all_blocks() if b.marker and b.marker.kind == "run"]
    assert any(b.page == README for b in runs), "the README's example is not run"
    assert len(runs) >= 5, [b.where for b in runs]
    files = {(b.page, b.marker.name) for b in all_blocks() if b.marker and b.marker.kind == "file"}
    assert (README, "train.py") in files


def test_markers_are_read_strictly() -> None:
    marker = parse_marker('run; expect "a; b \\"c\\""; timeout 30; exit 1; slow', "here")
    assert (marker.expect, marker.timeout_s, marker.exit_status, marker.slow) == (['a; b "c"'], 30, 1, True)
    for bad in ("shown:", "run; expect nothing", "runs", "file a/b.py", "skip"):
        with pytest.raises(ValueError, match="here"):
            parse_marker(bad, "here")


def test_python_blocks_compile() -> None:
    problems = []
    for block in all_blocks():
        if block.language in ("python", "py"):
            try:
                compile(block.text, block.where, "exec")
            except SyntaxError as e:
                problems.append(f"{block.where}: {e}")
    assert not problems, "\n".join(problems)


# --- names and paths in code ------------------------------------------------------------------------


def resolve(name: str) -> Any:
    """The object that a dotted name ``inprocess....`` names; AttributeError or ImportError if none."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue  # not a module: an attribute of a shorter one
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_the_inprocess_names_in_code_exist() -> None:
    names: dict[str, str] = {}
    for page in PAGES:
        for line, text in code_texts(page):
            for name in re.findall(r"(?<![\w.])inprocess(?:\.[A-Za-z_]\w*)+", text):
                names.setdefault(name, f"{page.relative_to(ROOT)}:{line}")
    assert len(names) > 20, names
    missing = []
    for name, where in sorted(names.items()):
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{where}: {name}: {type(e).__name__}: {e}")
    assert not missing, "names the docs use that the package does not have (moved or renamed?):\n" + "\n".join(missing)


REPO_PATH = re.compile(r"(?<![\w./-])((?:python|csrc|tests|examples|benchmarks|docs|tools|\.ci)/[\w.*/-]*[\w*])")
PACKAGE_PATH_WITHOUT_PREFIX = re.compile(r"(?<![\w./-])inprocess/[\w/]+\.pyi?\b")


def test_the_repository_paths_in_code_exist() -> None:
    problems = []
    for page in PAGES:
        for line, text in code_texts(page):
            where = f"{page.relative_to(ROOT)}:{line}"
            for path in REPO_PATH.findall(text):
                if not glob.glob(str(ROOT / path)):
                    problems.append(f"{where}: {path}: no such file in the repository")
            for path in PACKAGE_PATH_WITHOUT_PREFIX.findall(text):
                problems.append(f"{where}: {path}: a source path needs its python/ prefix (or a module name)")
    assert not problems, "\n".join(problems)


# --- links ------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for line in prose(page).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")


def links(page: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(prose(page).splitlines(), 1):
        line = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)
        found += [(number, target) for target in LINK.findall(line)]
    return found


def test_every_relative_link_and_anchor_resolves() -> None:
    problems, checked = [], 0
    for page in LINKED_PAGES:
        for line, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:
            where = f"{page.relative_to(ROOT)}:{line}"
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            checked += 1
            if not dest.exists():
                problems.append(f"{where}: {target}: {path_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: {target}: no heading of {dest.relative_to(ROOT)} has the anchor #{anchor}")
    assert checked > 50, checked
    assert not problems, "\n".join(problems)


def test_the_anchor_rule_is_githubs() -> None:
    assert slug("Migrating from `nvidia_resiliency_ext.inprocess`") == "migrating-from-nvidia_resiliency_extinprocess"
    assert slug("GPU: NCCL abort, CUDA health, exit statuses") == "gpu-nccl-abort-cuda-health-exit-statuses"
    assert slug("Restart latency (issue: core engine)") == "restart-latency-issue-core-engine"
    assert slug("`python -m inprocess.launch --respawn N`") == "python--m-inprocesslaunch---respawn-n"


# --- the README -------------------------------------------------------------------------------------


def test_the_readme_is_a_page_for_users() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: it is the users' first page; move reference "
        "material into a page of docs/ and link it")
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in links(README)}
    unlinked = [p.relative_to(ROOT) for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"pages of docs/ that README.md does not link: {unlinked}"


def test_the_pages_carry_no_commit_hashes() -> None:
    """Run logs by commit belong in commit messages and benchmarks/README.md, not in the users' pages."""
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for token in re.findall(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/-])", line):
                if re.search(r"[a-f]", token) and re.search(r"[0-9]", token):
                    found.append(f"{page.relative_to(ROOT)}:{number}: {token}")
    assert not found, "\n".join(found)

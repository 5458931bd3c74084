"""Writes the code map of docs/design.md from the package's module docstrings.

    python tools/code_map.py           # rewrite the map in docs/design.md
    python tools/code_map.py --check   # exit 1, with a diff, if the committed map differs

The map lists every module of ``python/inprocess`` (``*.py``, and ``_native.pyi`` for the
extension), one table per package, each module with the first sentence of its docstring.
It sits in docs/design.md between the two marker lines below; the rest of the page is
written by hand. tests/test_docs_code_map.py fails when the committed map is not what this
script writes, so a new, moved or renamed module is one command away from its row.
The package is read with ``ast``, never imported: no torch, no extension needed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import pathlib
import re
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "inprocess"
DESIGN = ROOT / "docs" / "design.md"
BEGIN = "<!-- code-map: written by `python tools/code_map.py` from the module docstrings; do not edit -->"
END = "<!-- /code-map -->"
COMMAND = "python tools/code_map.py"


@dataclass(frozen=True)
class Module:
    name: str  # inprocess.control.protocol
    path: pathlib.Path  # relative to ROOT
    summary: str  # the docstring's first sentence, in Markdown

    @property
    def package(self) -> str:
        """The package whose table lists this module (a package lists itself in its own table)."""
        if self.path.stem == "__init__":
            return self.name
        return self.name.rsplit(".", 1)[0]


def module_files(package: pathlib.Path = PACKAGE) -> list[pathlib.Path]:
    """Every module file of the package: its ``.py`` files and the extension's stub."""
    files = [p for p in package.rglob("*.py") if "__pycache__" not in p.parts]
    files += list(package.glob("_native.pyi"))
    return sorted(files)


def module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def markdown(text: str) -> str:
    """reST inline markup as Markdown: ``x`` and :role:`x` become `x` (``~a.b.C`` becomes `C`)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: "`" + _role_target(m.group(0), m.group(1)) + "`", text)
    return text.replace("``", "`")


def _role_target(whole: str, target: str) -> str:
    return target.rsplit(".", 1)[-1] if "`~" in whole else target


def first_sentence(doc: str) -> str:
    """The first sentence of the docstring's first paragraph, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    match = re.search(r"(?<=\.)\s+(?=[A-Z`:(*])", paragraph)
    sentence = paragraph[: match.start()] if match else paragraph
    return sentence.rstrip(":")  # "... as follows::" introduces a literal block: the row ends before it


def read_module(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> Module:
    """The module's row: ``package`` is the package directory (python/inprocess) it lies under."""
    relative = path.relative_to(package.parents[1])
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    if not doc or not doc.strip():
        raise ValueError(f"{relative} has no module docstring: its first sentence is its row in the code map "
                         f"(docs/design.md); add one, then run {COMMAND}")
    return Module(module_name(path, package), relative, markdown(first_sentence(doc)))


def render(modules: list[Module]) -> str:
    """The map: one table per package, the package's own line first."""
    packages: dict[str, list[Module]] = {}
    for m in modules:
        packages.setdefault(m.package, []).append(m)
    lines = [BEGIN, ""]
    for package in sorted(packages, key=lambda name: (name != "inprocess", name)):
        lines += [f"#### `{package}`", "", "| module | what it is |", "|---|---|"]
        for m in sorted(packages[package], key=lambda m: (m.name != package, m.name)):
            label = "__init__" if m.name == package else m.name.rsplit(".", 1)[-1]
            summary = m.summary.replace("|", "\\|")
            lines.append(f"| [`{label}`](../{m.path.as_posix()}) | {summary} |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def current_map(package: pathlib.Path = PACKAGE) -> str:
    return render([read_module(p, package) for p in module_files(package)])


def replace_map(page: str, new_map: str) -> str:
    """``page`` with the text between the markers (the markers included) replaced by ``new_map``."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DESIGN.name}: the code map's markers are missing; put these two lines "
                         f"where the map belongs, then run {COMMAND}:\n{BEGIN}\n{END}")
    return page[:start] + new_map + page[end + len(END):]


def diff(old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        "docs/design.md (committed)", "docs/design.md (from the docstrings)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 with a diff if the map differs")
    args = parser.parse_args(argv)
    page = DESIGN.read_text()
    wanted = replace_map(page, current_map())
    if wanted == page:
        print("docs/design.md: the code map is up to date")
        return 0
    if args.check:
        print(diff(page, wanted), end="")
        print(f"docs/design.md: the code map differs from the module docstrings; run {COMMAND}")
        return 1
    DESIGN.write_text(wanted)
    print("docs/design.md: the code map is written")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The extension module as a whole: its type stub names exactly what it has,
and its version is the package's (one source: pyproject.toml)."""

from __future__ import annotations

import ast
import enum
import inspect
import pathlib
import re
import socket
import sys
from importlib import metadata
from pathlib import Path

import pytest

import inprocess
from inprocess import _native

STUB = Path(inprocess.__file__).with_name("_native.pyi")
REPO = Path(__file__).resolve().parent.parent


def stub_names() -> dict[str, set[str]]:
    """Top-level names of the stub, each class with the public names it declares."""
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            members: set[str] = set()
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        members.add(item.name)
                    elif isinstance(item, ast.Assign):
                        members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
            names[node.name] = {m for m in members if not m.startswith("_") or m == "__init__"}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = set()
        elif isinstance(node, ast.Assign):
            names.update((t.id, set()) for t in node.targets if isinstance(t, ast.Name))
    return names


def is_enum_stub(name: str) -> bool:
    tree = ast.parse(STUB.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return any(ast.unparse(b) == "enum.Enum" for b in node.bases)
    return False


def module_members(obj: object) -> set[str]:
    """Public names an extension class (or submodule) defines itself."""
    own = vars(obj) if inspect.ismodule(obj) else obj.__dict__
    return {n for n in own if not n.startswith("_")}


def test_stub_top_level_names_match_the_module() -> None:
    declared = set(stub_names())
    present = {n for n in vars(_native) if not n.startswith("_")} | {"__version__"}
    assert declared - present == set(), "declared in _native.pyi but missing from the module"
    assert present - declared == set(), "in the module but not declared in _native.pyi"


@pytest.mark.parametrize("name", sorted(n for n, members in stub_names().items() if members))
def test_stub_class_members_match_the_module(name: str) -> None:
    declared = stub_names()[name]
    obj = getattr(_native, name)
    if is_enum_stub(name):
        assert set(declared) == set(obj.__members__), f"{name}: enum values differ"
        for member in declared:
            # The stub writes `NAME = value`: the values must agree too.
            stub_value = _enum_stub_values(name)[member]
            assert int(getattr(obj, member)) == stub_value, f"{name}.{member}"
        return
    present = module_members(obj)
    if "__init__" in declared:
        present.add("__init__")
    assert declared - present == set(), f"{name}: declared in the stub but missing"
    assert present - declared == set(), f"{name}: in the module but not declared in the stub"


def _enum_stub_values(name: str) -> dict[str, int]:
    tree = ast.parse(STUB.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                t.id: ast.literal_eval(item.value)
                for item in node.body
                if isinstance(item, ast.Assign)
                for t in item.targets
                if isinstance(t, ast.Name)
            }
    raise KeyError(name)


def test_stub_declares_enums_as_enums() -> None:
    # pybind11 enums are not enum.Enum subclasses; the stub says Enum so that
    # type checkers see the members. Guard that each one really is a pybind11 enum.
    for name in stub_names():
        if is_enum_stub(name):
            assert hasattr(getattr(_native, name), "__members__"), name
            assert not issubclass(getattr(_native, name), enum.Enum), name


def pyproject_version() -> str:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the CI interpreter is 3.11+
        pytest.skip("tomllib needs Python 3.11")
    with open(REPO / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def test_version_has_one_source() -> None:
    expected = pyproject_version()
    assert _native.__version__ == expected, "the extension was built from another pyproject.toml version"
    assert inprocess.__version__ == expected
    assert metadata.version("inprocess") == expected


def test_the_bindings_name_no_module_of_the_package() -> None:
    """The native module sits below the package: it imports none of its modules (the errors it raises
    are handed down once by inprocess.control: control/store_errors.py)."""
    csrc = pathlib.Path(__file__).resolve().parent.parent / "csrc"
    imports = [f"{p.name}:{n}" for p in sorted(csrc.rglob("*.cpp")) for n, line in
               enumerate(p.read_text().splitlines(), 1) if re.search(r'import\(\s*"inprocess', line)]
    assert imports == []


def test_the_native_errors_are_the_packages_own() -> None:
    from inprocess.control.store_errors import StoreConnectionError

    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()  # nothing listens there now
    with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{free}"):
        _native.StoreConnection("127.0.0.1", free, timeout=1.0, connect_timeout=0.5, retry_refused=False)

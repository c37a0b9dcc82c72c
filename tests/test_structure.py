"""The package's shape, as the module map of docs/architecture.md states it.

Checked from the source with ``ast`` (nothing is imported): no module of ``p2pkv`` over
:data:`MAX_MODULE_LINES` lines, no class over :data:`MAX_CLASS_LINES`, no library
function over :data:`MAX_FUNCTION_LINES`, and no cycle among the modules' imports
(those made only for the type checker, in ``if TYPE_CHECKING`` blocks, count like any
other; so do imports inside functions, which only put off the cost of a module, never
hide an edge). The module map is read from docs/architecture.md: every module is named
in it, imports go only to the module's own entry or to entries above it, and what it
marks "(pure)" imports nothing of :data:`IMPURE`. Every error class of the library
derives from ``P2PKVError``. No module reads the call stack (the vLLM integration takes
what it needs from vLLM's API, never from its callers' locals). The checkers are tested
on small synthetic packages and texts too, so a broken checker cannot pass silently.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "p2pkv"
MAX_MODULE_LINES = 540
MAX_CLASS_LINES = 360
MAX_FUNCTION_LINES = 80
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
#: What a module marked "(pure)" may not import (anywhere in it): IO, processes, threads,
#: clocks, the GPU stack.
IMPURE = frozenset({"zmq", "torch", "socket", "threading", "subprocess", "multiprocessing",
                    "mmap", "os", "pathlib", "time", "asyncio", "select", "selectors"})


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the package ``root``."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements at module level: into if/try/with blocks (``if TYPE_CHECKING:`` too: a
    module the type checker needs is a dependency all the same), not into defs."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _module_level(stmt.body)
            yield from _module_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody,
                          *[h.body for h in stmt.handlers]):
                yield from _module_level(block)
        elif isinstance(stmt, ast.With):
            yield from _module_level(stmt.body)


def _everywhere(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement, inside functions too (a deferred import still binds the two
    modules), and what only a type checker runs."""
    for stmt in body:
        yield stmt
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if isinstance(block, list):
                yield from _everywhere([b for b in block if isinstance(b, ast.stmt)])
        for handler in getattr(stmt, "handlers", ()):
            yield from _everywhere(handler.body)


def import_graph(root: Path, *, deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level, for the type checker
    too (``deferred``: also inside functions, where an import only hides a dependency
    from this graph)."""
    mods = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    walk = _everywhere if deferred else _module_level
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for stmt in walk(tree.body):
            targets: list[str] = []
            if isinstance(stmt, ast.Import):
                targets = [a.name for a in stmt.names]
            elif isinstance(stmt, ast.ImportFrom):
                if stmt.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (stmt.level - 1)]
                    source = ".".join([*base, *([stmt.module] if stmt.module else [])])
                else:
                    source = stmt.module or ""
                targets = [source]
                # ``from pkg import submodule`` imports the submodule too.
                targets += [f"{source}.{a.name}" for a in stmt.names
                            if f"{source}.{a.name}" in mods]
            for target in targets:
                if target in mods and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (first module repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                return [*stack[stack.index(nxt):], nxt]
            if color[nxt] == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE:
            found = visit(node)
            if found:
                return found
    return None


def long_modules(root: Path, limit: int) -> list[str]:
    out = []
    for name, path in modules(root).items():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{name}: {n} lines")
    return out


def long_classes(root: Path, limit: int) -> list[str]:
    out = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    out.append(f"{name}.{node.name}: {n} lines")
    return out


@dataclass
class Entry:
    """One top-level line of the module map and the lines under it."""

    paths: list[str]  # "p2pkv/x.py" or "p2pkv/pkg/" (a package)
    text: str = ""
    pure: bool = False  # the head line says "(pure)": every module of the entry is
    pure_files: set[str] = field(default_factory=set)  # sub-entries marked "(pure)"


def design_entries(doc: str, package: str = "p2pkv") -> list[Entry]:
    """The module map of ``doc`` (docs/architecture.md), bottom layer first."""
    match = re.search(r"^## The module map\n.*?^```\n(.*?)^```", doc, re.S | re.M)
    assert match, "the architecture page has no module map"
    entries: list[Entry] = []
    for line in match.group(1).splitlines():
        if line.startswith(package + "/"):
            names = re.split(r"\s{2,}", line, maxsplit=1)[0].split(", ")
            first = names[0]
            base = first[: first.rstrip("/").rfind("/") + 1]
            entries.append(Entry([first, *(base + n for n in names[1:])],
                                 pure="(pure)" in line))
        else:
            assert entries, f"a module-map line before any entry: {line!r}"
            sub = re.match(r"^ {4}(\S.*?)(?:\s{2,}|$)", line)
            if sub and "(pure)" in line:
                entries[-1].pure_files.update(sub.group(1).split(", "))
        entries[-1].text += line + "\n"
    return entries


def _entry_of(rel: str, entries: list[Entry]) -> int | None:
    """Index of the entry that holds module file ``rel`` (``p2pkv/a/b.py``): the one that
    names it, else the one of its innermost package (``p2pkv/a/b/`` before ``p2pkv/a/``)."""
    best: tuple[int, int] | None = None  # (length of the matching path, entry)
    for i, entry in enumerate(entries):
        for path in entry.paths:
            matches = rel == path or (path.endswith("/") and rel.startswith(path))
            if matches and (best is None or len(path) > best[0]):
                best = (len(path), i)
    return None if best is None else best[1]


def design_problems(root: Path, doc: str) -> list[str]:
    """Every way the package differs from what the module map says."""
    entries = design_entries(doc, root.name)
    mods = modules(root)
    rel = {name: path.relative_to(root.parent).as_posix() for name, path in mods.items()}
    layer: dict[str, int] = {}
    problems: list[str] = []
    for name, path in rel.items():
        i = _entry_of(path, entries)
        if i is None:
            problems.append(f"{path}: not in the module map")
            continue
        layer[name] = i
        base = path.rsplit("/", 1)[-1]
        if base != "__init__.py" and path not in entries[i].paths and \
                not re.search(rf"(?<![\w.]){re.escape(base)}", entries[i].text):
            problems.append(f"{path}: its entry does not name {base}")
    for name, targets in import_graph(root, deferred=True).items():
        for target in sorted(targets):
            if name in layer and target in layer and layer[target] > layer[name]:
                problems.append(f"{rel[name]} imports {rel[target]}, listed below it")
    for name, path in rel.items():
        if name not in layer:
            continue
        entry = entries[layer[name]]
        if not (entry.pure or path.rsplit("/", 1)[-1] in entry.pure_files):
            continue
        for node in ast.walk(ast.parse(mods[name].read_text(encoding="utf-8"))):
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found = [node.module]
            for imported in found:
                if imported.split(".")[0] in IMPURE:
                    problems.append(f"{path} is marked pure but imports {imported}")
    return problems


#: What reading a caller's frame takes: the frame functions, and a frame's attributes.
FRAME_CALLS = frozenset({"currentframe", "_getframe", "stack", "getouterframes"})
FRAME_ATTRS = frozenset({"f_back", "f_locals", "f_globals"})


def frame_reads(root: Path) -> list[str]:
    """Every place a module of ``root`` reads the call stack (``inspect.currentframe()``,
    ``sys._getframe()``, ``inspect.stack()``, a frame's ``f_back``/``f_locals``/...):
    what vLLM hands the integration comes through its API, never from its callers'
    locals."""
    found: list[str] = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and (
                    node.attr in FRAME_ATTRS or (node.attr in FRAME_CALLS and
                    isinstance(node.value, ast.Name) and node.value.id in ("inspect", "sys"))):
                found.append(f"{name}:{node.lineno}: {node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("inspect", "sys"):
                found += [f"{name}:{node.lineno}: {a.name}" for a in node.names
                          if a.name in FRAME_CALLS]
    return found


# ------------------------------------------------------------------ the package itself


def test_no_caller_frame_is_read() -> None:
    assert frame_reads(PACKAGE) == []


def test_the_design_list_is_true() -> None:
    assert design_problems(PACKAGE, ARCHITECTURE.read_text(encoding="utf-8")) == []


def test_no_module_is_too_long() -> None:
    assert long_modules(PACKAGE, MAX_MODULE_LINES) == []


def test_no_class_is_too_long() -> None:
    assert long_classes(PACKAGE, MAX_CLASS_LINES) == []


def test_no_import_cycle() -> None:
    # Deferred imports count: one inside a function hides a cycle, it does not break it.
    graph = import_graph(PACKAGE, deferred=True)
    assert "p2pkv.runtime.connections.wiring" in graph["p2pkv.node"]  # the graph is not empty
    assert find_cycle(graph) is None


def test_lower_layers_never_import_the_node_or_the_tools() -> None:
    # Implied by the module map (the node and the tools are listed above these layers);
    # kept as its own statement of the rule that matters most.
    graph = import_graph(PACKAGE)
    upper = {"p2pkv.node", "p2pkv.cli", "p2pkv.demo"} | {
        m for m in graph if m.startswith(("p2pkv.bench", "p2pkv.commands"))}
    for name, targets in graph.items():
        if name.startswith(("p2pkv.protocol", "p2pkv.runtime", "p2pkv.store", "p2pkv.transport")):
            assert not targets & upper, f"{name} imports {sorted(targets & upper)}"


# ------------------------------------------------------------------ the checkers


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_checker_finds_an_import_cycle(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "a.py": "from pkg.b import x\n",
        "b.py": "import pkg.sub.c\nx = 1\n",
        "sub/__init__.py": "",
        "sub/c.py": "from .. import a\n",
        "d.py": "def f():\n    from pkg import a\n",  # deferred: not an edge
    })
    graph = import_graph(root)
    assert graph["pkg.d"] == set()
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert import_graph(root, deferred=True)["pkg.d"] == {"pkg", "pkg.a"}


def test_checker_finds_a_cycle_hidden_by_deferred_imports(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "a.py": "def f():\n    from pkg.b import y\n    return y\nx = 1\n",
        "b.py": "class B:\n    def g(self):\n        from pkg.a import x\n        return x\n"
                "y = 2\n",
    })
    assert find_cycle(import_graph(root)) is None
    assert find_cycle(import_graph(root, deferred=True)) == ["pkg.a", "pkg.b", "pkg.a"]


@pytest.mark.parametrize("guard", ["TYPE_CHECKING", "typing.TYPE_CHECKING"])
def test_checker_counts_type_checking_imports(tmp_path: Path, guard: str) -> None:
    # A circle closed only for the type checker is a circle: the two modules depend on
    # each other all the same (and one of them must import the other inside a function,
    # or the type checker's view and the interpreter's differ).
    root = _package(tmp_path, {
        "a.py": "import pkg.b\n",
        "b.py": f"import typing\nfrom typing import TYPE_CHECKING\nif {guard}:\n"
                "    from pkg import a\nelse:\n    from pkg import c\n",
        "c.py": "",
    })
    assert import_graph(root)["pkg.b"] == {"pkg", "pkg.a", "pkg.c"}
    assert find_cycle(import_graph(root)) == ["pkg.a", "pkg.b", "pkg.a"]
    assert find_cycle(import_graph(root, deferred=True)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_checker_counts_type_checking_imports_for_the_layers(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                  "    from pkg.high import H\n",
        "high.py": "H = 1\n",
    })
    doc = ("## The module map\n\n```\npkg/__init__.py    the root\n"
           "pkg/low.py         below\npkg/high.py        above\n```\n")
    assert design_problems(root, doc) == ["pkg/low.py imports pkg/high.py, listed below it"]


def test_checker_counts_imports_inside_functions_for_the_layers(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "low.py": "def later():\n    from pkg import high\n    return high\n",
        "high.py": "H = 1\n",
    })
    doc = ("## The module map\n\n```\npkg/__init__.py    the root\n"
           "pkg/low.py         below\npkg/high.py        above\n```\n")
    assert design_problems(root, doc) == ["pkg/low.py imports pkg/high.py, listed below it"]


def long_functions(root: Path, limit: int, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Functions and methods over ``limit`` lines (their whole text: signature,
    docstring, body), outside the modules that start with one of ``skip``."""
    out = []
    for name, path in modules(root).items():
        if any(name.startswith(s) for s in skip):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    out.append(f"{name}.{node.name}: {lines} lines")
    return out


def test_no_library_function_is_too_long() -> None:
    # The benchmarks are tools that script a run from top to bottom, not the library.
    assert long_functions(PACKAGE, MAX_FUNCTION_LINES, skip=("p2pkv.bench",)) == []


def test_checker_finds_long_functions(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(12))
    root = _package(tmp_path, {"big.py": f"def big():\n{body}\n", "tool/__init__.py": "",
                               "tool/run.py": f"async def run():\n{body}\n"})
    assert sorted(long_functions(root, 10)) == ["pkg.big.big: 13 lines",
                                                "pkg.tool.run.run: 13 lines"]
    assert long_functions(root, 10, skip=("pkg.tool",)) == ["pkg.big.big: 13 lines"]
    assert long_functions(root, 13) == []


def test_checker_finds_long_modules_and_classes(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(12))
    root = _package(tmp_path, {"big.py": f"class Big:\n{body}\n", "small.py": "y = 1\n"})
    assert long_modules(root, 10) == ["pkg.big: 13 lines"]
    assert long_classes(root, 10) == ["pkg.big.Big: 13 lines"]
    assert long_modules(root, 13) == [] and long_classes(root, 13) == []


def test_checker_reads_the_design_list(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "low.py": "import os\n",
        "high.py": "from pkg import low\n",
        "sub/__init__.py": "",
        "sub/a.py": "from pkg import high\n",
        "sub/b.py": "",
        "stray.py": "",
    })
    doc = (
        "## The module map\n\ntext\n\n```\n"
        "pkg/__init__.py    the root\n"
        "pkg/sub/           a package (pure):\n"
        "    a.py                first\n"
        "pkg/low.py, high.py   two modules\n"
        "                      (pure) mentioned on a continuation line only\n"
        "```\n"
    )
    entries = design_entries(doc, "pkg")
    assert [e.paths for e in entries] == [["pkg/__init__.py"], ["pkg/sub/"],
                                          ["pkg/low.py", "pkg/high.py"]]
    assert entries[1].pure and not entries[2].pure
    assert design_problems(root, doc) == [
        "pkg/stray.py: not in the module map",
        "pkg/sub/b.py: its entry does not name b.py",
        "pkg/sub/a.py imports pkg/high.py, listed below it",
    ]
    pure_low = doc.replace("pkg/low.py, high.py   two modules",
                           "pkg/low.py, high.py   two modules (pure)")
    assert "pkg/low.py is marked pure but imports os" in design_problems(root, pure_low)


def test_checker_puts_a_module_in_its_innermost_package(tmp_path: Path) -> None:
    # A package's entry below and a subpackage's entry above it (runtime/ and
    # runtime/paths/): each module belongs to the entry of its innermost package, or to
    # the entry that names it.
    root = _package(tmp_path, {
        "base/__init__.py": "",
        "base/core.py": "",
        "base/named.py": "",
        "base/up/__init__.py": "",
        "base/up/x.py": "from pkg.base import core\n",
        "base/up/y.py": "from pkg.base import named\n",
    })
    doc = ("## The module map\n\n```\npkg/__init__.py    the root\n"
           "pkg/base/          the base: core.py\n"
           "pkg/base/up/       above it: x.py, y.py\n"
           "pkg/base/named.py  named on its own, above all\n```\n")
    assert design_problems(root, doc) == [
        "pkg/base/up/y.py imports pkg/base/named.py, listed below it"]


def test_checker_finds_frame_reads(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "walk.py": "import inspect\nf = inspect.currentframe()\nup = f.f_back.f_locals\n",
        "grab.py": "from sys import _getframe\nimport sys\nsys._getframe(1)\n",
        "fine.py": "import inspect\nsig = inspect.signature(len)\n"})
    assert sorted(frame_reads(root)) == [
        "pkg.grab:1: _getframe", "pkg.grab:3: _getframe", "pkg.walk:2: currentframe",
        "pkg.walk:3: f_back", "pkg.walk:3: f_locals"]


#: Built-in exceptions a library error may also derive from (``except TimeoutError``
#: keeps working), never alone.
_BUILTIN_ERRORS = frozenset({"Exception", "RuntimeError", "ValueError", "TimeoutError",
                             "ConnectionError", "OSError", "EOFError", "KeyError",
                             "LookupError", "TypeError"})


def errors_outside(root: Path, base: str = "P2PKVError", *,
                   skip: tuple[str, ...] = ()) -> list[str]:
    """Exception classes of the package that do not derive from ``base`` (by name,
    through the package's own classes): each is ``module.Class``."""
    bases: dict[str, list[str]] = {}
    where: dict[str, str] = {}
    for name, path in modules(root).items():
        if any(name.startswith(s) for s in skip):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [b.id if isinstance(b, ast.Name) else
                                    b.attr if isinstance(b, ast.Attribute) else "" for b in
                                    node.bases]
                where[node.name] = f"{name}.{node.name}"

    def derives(cls: str, seen: frozenset[str] = frozenset()) -> bool | None:
        """True: from ``base``; False: an exception that is not; None: no exception."""
        if cls == base:
            return True
        if cls in _BUILTIN_ERRORS:
            return False
        if cls not in bases or cls in seen:
            return None
        found = [derives(b, seen | {cls}) for b in bases[cls]]
        return True if True in found else False if False in found else None

    return sorted(where[c] for c in bases if derives(c) is False)


def test_every_library_error_derives_from_p2pkv_error() -> None:
    # The benchmarks are tools, not the library: their errors stay their own.
    assert errors_outside(PACKAGE, skip=("p2pkv.bench",)) == []


def test_checker_finds_an_error_outside_the_root(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("class P2PKVError(Exception): ...\n"
                                   "class Good(P2PKVError, ValueError): ...\n")
    (pkg / "a.py").write_text("from pkg.errors import Good\nclass Also(Good): ...\n"
                              "class Bad(RuntimeError): ...\nclass Plain: ...\n")
    assert errors_outside(pkg) == ["pkg.a.Bad"]

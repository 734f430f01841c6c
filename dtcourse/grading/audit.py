"""Find the code in a submission that reaches into the grading: rebound check names, patched modules.

A check is only as good as the code that runs it. A solution cell that says
``check_all_reduce = lambda *a, **k: None``, or a cell that replaces a function inside
``dtcourse.checks`` or ``torch.distributed``, would turn every check into a pass. The test cells
import their checks themselves and the checks run fresh copies of their modules (see
``dtcourse.checks``), and this audit reports what is left: every place where a submission

* binds the name of one of the course's checks (a ``check_...`` function of ``dtcourse.checks``),
  other than by importing that very check from ``dtcourse.checks``; a helper of the student's own
  called ``check_split``, or one the exercise offers (``check_divides``), is left alone;
* assigns to, deletes or ``setattr``s an attribute or item of ``dtcourse``, ``torch`` (not
  ``torch.backends``), ``sys``, ``builtins`` or ``importlib`` (or of a name imported from them);
* names the grading's own guards (``dtcourse.runtime.refuse``, ``dtcourse.checks.guard``) or
  reloads a module.

Usage::

    dtcourse audit submitted/*/01_collectives_ring/*.ipynb    # exit 1 if anything is found

The checks run the same audit on the kernel's own history before they grade, so under
nbgrader such a notebook scores 0 in every test cell with a message that says why.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["Finding", "audit_source", "audit_cells", "audit_notebook", "first_line", "begins", "main"]

# Modules whose attributes a submission may not assign, delete or setattr. All of torch: the checks compare with
# torch.equal, Tensor methods and torch's own answers, so a patched torch.Tensor.__sub__ or torch.allclose could make
# every comparison pass. torch.backends holds switches a student may set (cudnn.deterministic).
GUARDED = ("dtcourse", "torch", "sys", "builtins", "importlib")
UNGUARDED = ("torch.backends",)
CHECKS_DIR = Path(__file__).resolve().parents[1] / "checks"
GUARDS = ("dtcourse.runtime.refuse", "dtcourse.checks.guard", "ReferenceRefused", "refuse_if_student",
          "student_on_stack")


@dataclass(frozen=True)
class Finding:
    """One place a submission reaches into the grading."""

    cell: int | None   # index of the code cell in the notebook (None: a single source)
    line: int
    what: str
    begins: str = ""   # the cell's first line: what the student and the instructor both see of it

    def __str__(self) -> str:
        where = f"cell {self.cell}{begins(self.begins)}, " if self.cell is not None else ""
        return f"{where}line {self.line}: {self.what}"


def first_line(code: str) -> str:
    """A cell's first non-blank line, shortened: the one name a notebook cell has on every screen."""
    line = next((ln.strip() for ln in code.splitlines() if ln.strip()), "")
    return line if len(line) <= 60 else line[:57] + "..."


def begins(line: str) -> str:
    return f" (the cell that begins {line!r})" if line else ""


@functools.lru_cache(maxsize=1)
def check_names() -> frozenset[str]:
    """The course's checks: every top-level ``check_...`` function of a ``dtcourse.checks`` module, and the
    ``check_...`` names its package binds (``check_x = _isolated(...)``)."""
    names = set()
    for path in CHECKS_DIR.glob("*.py"):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.FunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return frozenset(n for n in names if n.startswith("check_"))


def _guarded(module: str) -> bool:
    inside = lambda roots: any(module == g or module.startswith(g + ".") for g in roots)   # noqa: E731
    return inside(GUARDED) and not inside(UNGUARDED)


class _Visitor(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.modules: dict[str, str] = {}       # local name -> the module (or member) it was imported as
        self.depth = 0                          # inside a def or class: its names are local

    def _flag(self, node: ast.AST, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), what))

    def _path(self, node: ast.AST) -> str:
        """The dotted path an attribute chain stands for, with imported names spelled out ('' if local)."""
        parts = []
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute):
                parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "vars" and node.args:
            return ".".join([self._path(node.args[0]) or "<local>", *reversed(parts)])   # vars(module)[...]
        if not (isinstance(node, ast.Name) and node.id in self.modules):
            return ""
        return ".".join([self.modules[node.id], *reversed(parts)])

    def _bind(self, node: ast.AST, name: str, how: str) -> None:
        if name in check_names() and self.depth == 0:
            self._flag(node, f"{how} {name!r}, the name of one of the course's checks")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.modules[alias.asname] = alias.name
            else:
                self.modules[alias.name.split(".")[0]] = alias.name.split(".")[0]
            self._bind(node, alias.asname or alias.name.split(".")[0], "imports as")
            if any(alias.name.startswith(g) for g in GUARDS):
                self._flag(node, f"imports {alias.name}, part of the grading's guards")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            full = f"{module}.{alias.name}"
            if any(full.startswith(g) or alias.name == g for g in GUARDS):
                self._flag(node, f"imports {full}, part of the grading's guards")
            self.modules[alias.asname or alias.name] = full
            same_check = module.startswith("dtcourse.checks") and alias.asname in (None, alias.name)
            if not same_check:
                self._bind(node, alias.asname or alias.name, "imports as")
        self.generic_visit(node)

    def _targets(self, node: ast.AST, targets: Iterable[ast.AST], how: str) -> None:
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    self._bind(node, sub.id, how)
            if isinstance(target, (ast.Attribute, ast.Subscript)) and _guarded(self._path(target)):
                self._flag(node, f"{how} {ast.unparse(target)}, inside a module the grading relies on")

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node, node.targets, "assigns")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._targets(node, [node.target], "assigns")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets(node, [node.target], "assigns")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._targets(node, node.targets, "deletes")
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._targets(node, [node.target], "assigns")
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self._targets(node, [node.target], "assigns")
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.ClassDef) -> None:
        self._bind(node, node.name, "defines")
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Global(self, node: ast.Global) -> None:
        depth, self.depth = self.depth, 0
        for name in node.names:
            self._bind(node, name, "declares global")
        self.depth = depth

    def visit_Call(self, node: ast.Call) -> None:
        name = ast.unparse(node.func)
        if (name in ("setattr", "delattr") or name.endswith((".__setattr__", ".__delattr__"))) and node.args \
                and _guarded(self._path(node.args[0])):
            self._flag(node, f"calls {name} on {ast.unparse(node.args[0])}, a module the grading relies on")
        if name.endswith("reload") and "importlib" in name or name == "reload":
            self._flag(node, "reloads a module")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        text = ast.unparse(node)
        if any(text.startswith(g) for g in GUARDS[:2]):
            self._flag(node, f"uses {text}, part of the grading's guards")
        self.generic_visit(node)


def audit_source(code: str, visitor_class: type[_Visitor] = _Visitor) -> list[tuple[int, str]]:
    """``(line, what)`` for every place ``code`` reaches into the grading ([] if it does not parse); another
    ``visitor_class`` collects something else on the same walk (``grading.uses``: the module members named)."""
    try:
        tree = ast.parse(_without_magics(code))
    except SyntaxError:
        return []
    visitor = visitor_class()
    visitor.visit(tree)
    return sorted(set(visitor.found))


def audit_cells(cells: Iterable[str], visitor_class: type[_Visitor] = _Visitor) -> list[Finding]:
    """Audit cells in order; names a cell binds stay known to the cells after it (one kernel)."""
    found, prelude = [], ""
    for index, code in enumerate(cells):
        before = len(prelude.splitlines())
        for line, what in audit_source(prelude + code, visitor_class):
            if line > before:
                found.append(Finding(index, line - before, what))
        prelude += "".join(f"{line}\n" for line in _imports(code))
    return found


def _imports(code: str) -> list[str]:
    """The import statements of ``code``, so later cells know its module names (one line each)."""
    try:
        tree = ast.parse(_without_magics(code))
    except SyntaxError:
        return []
    return [ast.unparse(node).replace("\n", " ") for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            and all(not a.name.startswith("check_") for a in node.names)]


def _without_magics(code: str) -> str:
    """IPython lines (``%magic``, ``!shell``) become blank, so the rest parses as Python."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines())


def audit_notebook(notebook, visitor_class: type[_Visitor] = _Visitor) -> list[Finding]:
    """The findings in a notebook (a path, or one already read), numbered by the notebook's cells."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4) if isinstance(notebook, (str, Path)) else notebook
    codes = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    return [Finding(codes[f.cell][0], f.line, f.what, first_line(codes[f.cell][1]))
            for f in audit_cells((code for _, code in codes), visitor_class)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtcourse audit", description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    flagged = 0
    for path in args.notebooks:
        findings = audit_notebook(path)
        flagged += bool(findings)
        print(f"{path}: " + ("nothing found" if not findings else f"{len(findings)} finding(s)"))
        for finding in findings:
            print(f"  {finding}")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())

"""The package's shape: no import cycles, no private name used across modules, modules of a readable size.

The layer contract (imports point down) is import-linter's, in
``pyproject.toml``, run by ``make lint``; these checks complete it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "managed_solve"
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, level: int, name: str | None, is_package: bool) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in a module, lazy ones too."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node.level, node.module, is_package)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    found.append((sub, None, node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _name, _line in _imports(module, path):
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def _is_ancestor(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def test_no_import_cycles():
    """Between modules (a package's __init__ re-exporting its children is not a cycle)."""
    graph = {m: {t for t in ts if not _is_ancestor(m, t) and not _is_ancestor(t, m)}
             for m, ts in _graph().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_name_used_from_another_module():
    """``from .x import _name`` and ``x._name`` across modules; package-private modules are fine."""
    offences = []
    for module, path in MODULES.items():
        imported_modules = {}
        for target, name, line in _imports(module, path):
            if name is not None and name.startswith("_") and not name.startswith("__") \
                    and target in MODULES and target != module:
                offences.append(f"{module}:{line} imports {target}.{name}")
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, node.level, node.module, path.name == "__init__.py")
                for alias in node.names:
                    if f"{target}.{alias.name}" in MODULES:
                        imported_modules[alias.asname or alias.name] = f"{target}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES and alias.asname:
                        imported_modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                target = imported_modules.get(node.value.id)
                if target is not None and target != module and not target.split(".")[-1].startswith("_"):
                    offences.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
                elif target is not None and target.split(".")[-1].startswith("_") \
                        and node.attr.startswith("_"):
                    offences.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
    assert not offences, "private names used across modules:\n" + "\n".join(offences)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_of_a_readable_size(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}): split it on its concerns"


#: The modules that may compare a device kind with "cuda": the backend and the Device itself.
CUDA_KIND_MODULES = ("managed_solve._backend", "managed_solve.devices")


def _cuda_kind_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing something named ``*kind`` with "cuda" (``==``, ``!=``, ``in``, either side)."""

    def is_cuda(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value == "cuda"
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(is_cuda, node.elts))

    def is_kind(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.endswith("kind")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(is_cuda, operands)) and any(map(is_kind, operands)):
                lines.append(node.lineno)
    return lines


def test_the_cuda_kind_check_sees_every_form():
    found = _cuda_kind_comparisons(ast.parse(
        'a = dev.kind == "cuda"\nb = "cuda" != kind\nc = device_kind in ("sim", "cuda")\n'
        'd = system.kind == "csr"\ne = t.backend == "cuda"\n'))
    assert found == [1, 2, 3]


def test_no_cuda_kind_strings_outside_the_backend():
    """Code asks ``Device.is_cuda``, ``devices.is_cuda_kind`` or ``device_args.cuda_ordinal`` instead."""
    offences = [f"{module}:{line}" for module, path in MODULES.items()
                if not module.startswith(CUDA_KIND_MODULES)
                for line in _cuda_kind_comparisons(ast.parse(path.read_text(), str(path)))]
    assert not offences, "device kinds compared with 'cuda' outside the backend:\n" + "\n".join(offences)


TESTS = Path(__file__).resolve().parent
#: The calls that replace or remove a name for a test (pytest's ``monkeypatch``, ``mock.patch``).
PATCHING = frozenset({"setattr", "delattr", "setitem", "delitem", "patch", "object"})


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign_names(tree: ast.AST) -> set[str]:
    """Names a test file binds by importing something other than managed_solve (os, numba, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] != "managed_solve"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 \
                and (node.module or "").split(".")[0] not in ("managed_solve", "tests"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _private_patches(source: str) -> list[int]:
    """Lines where a test patches a private name of managed_solve.

    Caught: ``monkeypatch.setattr(obj, "_name", ...)`` on an object that is
    not imported from another library; ``monkeypatch.setattr(mod._private,
    "name", ...)`` (a private module or attribute reached through another);
    and ``monkeypatch.setattr("managed_solve.x._name", ...)`` (any private
    part of a dotted path). ``delattr``, ``setitem`` and ``mock.patch``
    likewise.
    """
    tree = ast.parse(source)
    foreign = _foreign_names(tree)
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in PATCHING and node.args):
            continue
        target, rest = node.args[0], node.args[1:]
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            parts = target.value.split(".")
            if parts[0] == "managed_solve" and any(map(_is_private, parts)):
                lines.append(node.lineno)
            continue
        root, reached = target, []
        while isinstance(root, ast.Attribute):
            reached.append(root.attr)
            root = root.value
        if isinstance(root, ast.Name) and root.id in foreign:
            continue
        named = rest[0].value if rest and isinstance(rest[0], ast.Constant) else None
        if any(map(_is_private, reached)) or (isinstance(named, str) and _is_private(named)):
            lines.append(node.lineno)
    return lines


def test_the_private_patch_check_sees_every_form():
    found = _private_patches(
        "import os\nfrom managed_solve.solvers import direct\n"
        'monkeypatch.setattr(direct, "_superlu", f)\n'  # 3: a private function
        'monkeypatch.setattr(threads._backend, "thread_pool", f)\n'  # 4: a private module reached
        'monkeypatch.setattr("managed_solve.solvers.direct._superlu", f)\n'  # 5: by its path
        'mp.delattr(Runner, "_regroup")\n'  # 6
        'monkeypatch.setattr(direct, "superlu", f)\n'  # public: fine
        'monkeypatch.setattr(os, "_exit", f)\n'  # another library's: not ours to judge
        'monkeypatch.setattr("managed_solve.config.current", f)\n'
        'monkeypatch.setitem(cuda._modules, k, v)\n')  # 10
    assert found == [3, 4, 5, 6, 10]


def test_tests_patch_no_private_name_of_the_package():
    """Tests replace what the package offers as a seam (a parameter, a hook, a public function), never ``_names``."""
    offences = [f"{path.relative_to(TESTS.parent)}:{line}" for path in sorted(TESTS.rglob("*.py"))
                for line in _private_patches(path.read_text())]
    assert not offences, ("tests patching private names of managed_solve (add a seam or test the "
                          "behaviour through the public API):\n" + "\n".join(offences))


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines reading the process environment: ``os.environ`` (any use) or ``os.getenv``."""
    return sorted({node.lineno for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                   and isinstance(node.value, ast.Name) and node.value.id == "os"})


def test_the_environment_check_sees_every_form():
    found = _environment_reads(ast.parse(
        'a = os.environ.get("X")\nb = os.getenv("Y")\nc = os.environ["Z"]\nd = config.environment("W")\n'
        'e = "X" in os.environ\n'))
    assert found == [1, 2, 3, 5]


def test_environment_variables_are_read_in_one_place():
    """Every variable goes through ``config.environment``, which lists the ones the library reads."""
    offences = [f"{module}:{line}" for module, path in MODULES.items() if module != "managed_solve.config"
                for line in _environment_reads(ast.parse(path.read_text(), str(path)))]
    assert not offences, "environment read outside managed_solve.config:\n" + "\n".join(offences)


def _number(node: ast.AST) -> float | None:
    """A literal number (``2.0``, ``-1``), else None."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return value if isinstance(value, (int, float)) else None


def _laplacian_builds(source: str) -> list[int]:
    """Lines building a Laplacian inline: ``sp.kronsum(...)`` or ``diags`` of ``[-1, 2, -1]``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        if name == "kronsum":
            lines.append(node.lineno)
        elif name == "diags" and node.args and isinstance(node.args[0], (ast.List, ast.Tuple)):
            values = [_number(e) for e in node.args[0].elts]
            if values == [-1.0, 2.0, -1.0]:
                lines.append(node.lineno)
    return lines


def test_the_laplacian_check_sees_every_form():
    found = _laplacian_builds(
        'T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(8, 8))\n'
        'A = sp.kronsum(T, T)\nB = diags([-1, 2, -1], [-1, 0, 1])\n'
        'C = sp.diags([-1.0, 4.0, -1.5], [-1, 0, 1])\nD = sp.diags(d)\nE = sp.diags([f(1), 2.0, -1.0])\n')
    assert found == [1, 2, 3]


def test_tests_take_their_laplacians_from_the_gallery():
    """One gallery of model problems (``tests/_problems.py``): no test file builds its own Poisson matrix."""
    offences = [f"{path.relative_to(TESTS.parent)}:{line}" for path in sorted(TESTS.rglob("*.py"))
                if path.name != "_problems.py" for line in _laplacian_builds(path.read_text())]
    assert not offences, "Laplacians built outside tests/_problems.py:\n" + "\n".join(offences)


def test_no_package_function_is_named_like_a_test():
    """pytest collects ``test_*`` functions from any file it is pointed at; the package's are not tests."""
    offences = [f"{module}:{node.lineno} {node.name}" for module, path in MODULES.items()
                for node in ast.walk(ast.parse(path.read_text(), str(path)))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name.startswith("test_")]
    assert not offences, "functions named test_* in the package:\n" + "\n".join(offences)

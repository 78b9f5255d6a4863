"""The package's layering, read from its import statements (no module is imported here).

Layers, bottom up: the core (layer, norms, specs, ops, reference, ...) knows nothing of
how it is run; ``runtime/`` runs Megatron (launcher, CPU shim, the GPT runtime); ``check/``,
``training/``, ``research/`` and ``cli`` use the runtime. The CPU shim is installed by the
launcher and the Megatron-LM runner only (and the tests).
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_siamese"
CORE_MAY_NOT_IMPORT = ("runtime", "check", "training", "research", "cli", "inference", "hf", "evaluation", "plan")
MAX_LINES = 400  # a module longer than this says why in its docstring
HARD_MAX_LINES = 450  # and none is longer than this: split it by concern


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(name: str) -> str:
    """``megatron_siamese.runtime.gpt`` -> ``runtime``; the package itself -> ``""``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path, top_level_only: bool = False):
    """Package modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            found |= submodules or {node.module}
    return {name for name in found if name in MODULES}


def test_the_scan_sees_the_package():
    assert {"megatron_siamese.layer", "megatron_siamese.runtime.gpt", "megatron_siamese.check.step"} <= MODULES.keys()
    assert "megatron_siamese.runtime.cpu_shim" in imports(MODULES["megatron_siamese.runtime.job"])


def test_no_import_cycles():
    """Function-level imports count too: a cycle deferred into a function is still a cycle."""
    graph = {name: imports(path) - {name} for name, path in MODULES.items()}
    state = {}

    def visit(name, stack):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(target):] + [target]))
            if target not in state:
                visit(target, stack + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer_of(n) not in CORE_MAY_NOT_IMPORT))
def test_core_modules_do_not_import_the_runners(name):
    upward = {m for m in imports(MODULES[name]) if layer_of(m) in CORE_MAY_NOT_IMPORT}
    assert upward == set(), f"{name} imports {sorted(upward)}"


def test_one_module_decides_whether_cuda_is_used():
    """``megatron_siamese.device`` asks torch once; nothing else asks, and nothing puts tensors on
    ``torch.cuda.current_device()`` (on CPU that works only through the shim's redirection)."""
    def asks(path):
        return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr in ("is_available", "current_device")
                   and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "cuda"
                   for node in ast.walk(ast.parse(path.read_text())))

    assert {name for name, path in MODULES.items() if asks(path)} == {"megatron_siamese.device"}


def test_only_the_launchers_install_the_cpu_shim():
    users = {name for name, path in MODULES.items() if "megatron_siamese.runtime.cpu_shim" in imports(path)}
    # (and the process Megatron starts beside a rank to write its async checkpoints)
    assert users == {"megatron_siamese.runtime.job", "megatron_siamese.runtime.megatron_lm",
                     "megatron_siamese.runtime.cpu_checkpoint_worker"}


def test_no_module_is_over_the_hard_limit():
    over = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > HARD_MAX_LINES}
    assert over == {}, f"modules over {HARD_MAX_LINES} lines: {over}"


def test_long_modules_say_why():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()
            if len(path.read_text().splitlines()) > MAX_LINES}
    unexplained = [name for name in long
                   if not re.search(r"\bis long because\b", ast.get_docstring(ast.parse(MODULES[name].read_text())) or "")]
    assert unexplained == [], f"modules over {MAX_LINES} lines whose docstring does not say why: {long}"

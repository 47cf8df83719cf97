"""T0: the dependency arrows (docs/architecture.md), relative imports, no import cycles, no monkeypatching,
and nodes/ holding node classes only.

    __init__ -> nodes -> {comfy_merge, hooks, patcher, merge} -> comfy
    comfy_merge -> merge, hooks (allowed)   comfy_merge -X-> nodes, patcher
    hooks -> patcher (allowed)      patcher -X-> hooks, merge, nodes, comfy_merge
    merge   -X-> nodes, comfy_merge, hooks, patcher, comfy, folder_paths
    folder_paths is imported only from nodes/ and comfy_merge/; server and core `nodes` only from nodes/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.t0

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nodes", "comfy_merge", "hooks", "patcher", "merge")
COMFY_TOP = {"comfy", "comfy_extras", "comfy_api", "comfy_execution", "folder_paths", "server", "nodes",
             "node_helpers", "latent_preview", "execution", "app"}
FORBIDDEN = {
    "comfy_merge": {"nodes", "patcher", "server", "core nodes"},
    "hooks": {"nodes", "comfy_merge", "merge", "folder_paths", "server", "core nodes"},
    "patcher": {"nodes", "comfy_merge", "hooks", "merge", "folder_paths", "server", "core nodes"},
    "merge": {"nodes", "comfy_merge", "hooks", "patcher", "comfy", "comfy_extras", "comfy_api",
              "folder_paths", "server", "core nodes"},
}
CORE_MODULES_FROM = {"nodes": {"folder_paths", "server", "core nodes"}, "comfy_merge": {"folder_paths"}}


def pack_files() -> list[Path]:
    files = [ROOT / "__init__.py"]
    for package in PACKAGES:
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def imported_targets(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, target) per import: our subpackage name, 'core nodes', or an absolute top-level module."""
    rel = path.relative_to(root)
    depth_parts = rel.parts[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, _absolute(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                out.append((node.lineno, _absolute(node.module or "")))
                continue
            base = list(depth_parts[: len(depth_parts) - (node.level - 1)])
            parts = base + (node.module.split(".") if node.module else [])
            if parts:
                out.append((node.lineno, parts[0]))
            else:  # "from .. import x" at the pack root
                out += [(node.lineno, alias.name) for alias in node.names]
    return out


def _absolute(module: str) -> str:
    top = module.split(".")[0]
    return "core nodes" if top == "nodes" else top


@pytest.mark.parametrize("path", pack_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_dependency_arrows(path):
    owner = path.relative_to(ROOT).parts[0]
    forbidden = FORBIDDEN.get(owner, set())
    bad = [(line, target) for line, target in imported_targets(path) if target in forbidden]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}, which STYLE.md's arrows forbid for {owner}/"


@pytest.mark.parametrize("path", pack_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pack_imports_are_relative(path):
    absolute_own = [(line, t) for line, t in imported_targets(path)
                    if t in PACKAGES and not _is_relative_line(path, line)]
    assert not absolute_own, (
        f"{path.name}: import our own modules relatively (ComfyUI imports the pack by its path)")


def _is_relative_line(path: Path, line: int) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.lineno == line:
            return node.level > 0
    return False


def test_core_modules_only_from_nodes():
    """server and core ``nodes`` from nodes/ only; folder_paths from nodes/ and comfy_merge/ (the merge
    nodes' adapters: files inside ComfyUI's folders)."""
    for path in pack_files():
        allowed = CORE_MODULES_FROM.get(path.relative_to(ROOT).parts[0], set())
        for line, target in imported_targets(path):
            assert target not in {"folder_paths", "server", "core nodes"} - allowed, \
                f"{path}:{line} imports {target}"


PATCHED_TOPS = {"comfy", "comfy_extras", "comfy_api", "torch", "folder_paths", "nodes"}


def monkeypatches(source: str) -> list[tuple[int, str]]:
    """(line, target) of every assignment or ``setattr`` onto a ComfyUI or torch module or class,
    also through a name an import bound to one (``import comfy.model_management as mm``,
    ``from comfy import model_patcher``, ``import torch.nn.functional as F``)."""
    tree = ast.parse(source)
    aliases = set(PATCHED_TOPS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] in PATCHED_TOPS}
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.split(".")[0] in PATCHED_TOPS):
            aliases |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if isinstance(target, ast.Attribute) and _root_name(target) in aliases:
                found.append((node.lineno, ast.unparse(target)))
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if is_call and node.func.id in {"setattr", "delattr"}:
            first = node.args[0] if node.args else None
            if first is not None and _root_name(first) in aliases:
                found.append((node.lineno, f"{node.func.id}({ast.unparse(first)}, ...)"))
    return found


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@pytest.mark.parametrize("path", pack_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_monkeypatching_of_comfy_or_torch(path):
    found = monkeypatches(path.read_text())
    assert not found, (f"{path.name} assigns to {found}; use wrappers, callbacks, object patches or "
                       "injections instead")


@pytest.mark.parametrize("source", [
    "import comfy.model_management as mm\nmm.vram_state = None\n",
    "from comfy import model_patcher\nmodel_patcher.ModelPatcher.load = None\n",
    "import comfy.model_management as mm\nsetattr(mm, 'vram_state', None)\n",
    "import torch.nn.functional as F\nF.linear = None\n",
    "from comfy.model_patcher import ModelPatcher\nModelPatcher.clone = None\n",
    "import comfy.sd\ncomfy.sd.load_checkpoint_guess_config = None\n",
    "import torch\ntorch.nn.Linear.forward += 1\n",
])
def test_monkeypatch_checker_catches_aliases(source):
    assert monkeypatches(source), source


def test_monkeypatch_checker_leaves_own_objects_alone():
    source = ("import comfy.model_management as mm\nclass A:\n    pass\na = A()\n"
              "a.x = mm.get_torch_device()\nstate = {}\nstate['k'] = 1\nsetattr(a, 'y', 2)\n")
    assert monkeypatches(source) == []


def test_root_init_only_exports_mappings():
    tree = ast.parse((ROOT / "__init__.py").read_text())
    names = {t.id for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name)}
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert imported <= {"NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"}
    assert names <= {"__all__", "WEB_DIRECTORY"}


def test_architecture_checker_catches_a_forbidden_import(tmp_path):
    """The checker itself works: a fake hooks/ module importing ..nodes and folder_paths is reported,
    and so is a patcher/ module that names the hook engine (``..hooks``)."""
    (tmp_path / "hooks").mkdir()
    bad = tmp_path / "hooks" / "bad.py"
    bad.write_text("from ..nodes import floats\nimport folder_paths\nfrom . import fine\n"
                   "from ..patcher import registry\n")
    targets = {t for _, t in imported_targets(bad, root=tmp_path)}
    assert targets & FORBIDDEN["hooks"] == {"nodes", "folder_paths"}
    (tmp_path / "patcher").mkdir()
    engine_user = tmp_path / "patcher" / "bad.py"
    engine_user.write_text("from ..hooks.engine import HookEngine\n")
    assert {t for _, t in imported_targets(engine_user, root=tmp_path)} & FORBIDDEN["patcher"] == {"hooks"}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _package_of(path: Path, root: Path = ROOT) -> list[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1]


def _existing(parts: list[str], root: Path = ROOT) -> str | None:
    target = root.joinpath(*parts)
    if target.with_suffix(".py").is_file() or (target / "__init__.py").is_file():
        return ".".join(parts)
    return None


def pack_imports(path: Path, root: Path = ROOT) -> set[str]:
    """The pack modules ``path`` imports at run time: relative imports (``from .x import y`` names ``x``,
    and ``x.y`` where that is a module), and ``importlib.import_module`` of a literal relative name,
    which hides an import from a reader but not from this check; not those under ``if TYPE_CHECKING``."""
    package = _package_of(path, root)
    found: set[str] = set()

    def relative(level: int, module: str | None, names: list[str]) -> None:
        base = package[: len(package) - (level - 1)] if level > 1 else list(package)
        parts = base + (module.split(".") if module else [])
        modules = {n for alias in names if (n := _existing([*parts, alias], root))}
        if parts and (module or not modules) and (name := _existing(parts, root)):
            found.add(name)  # "from . import sub" imports the module sub, not (for this check) its package
        found.update(modules)

    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {id(inner) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
                   for statement in block.body for inner in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: never imported at run time
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            relative(node.level, node.module, [alias.name for alias in node.names])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            name = node.args[0].value
            level = len(name) - len(name.lstrip("."))
            if level:
                relative(level, name[level:] or None, [])
    found.discard(_module_name(path, root))
    return found


def import_cycles(root: Path = ROOT, files: list[Path] | None = None) -> list[list[str]]:
    """Every cycle of pack modules importing each other (function-level imports included): the
    strongly connected components of more than one module."""
    graph = {_module_name(p, root): pack_imports(p, root) for p in (files or pack_files())}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles():
    assert import_cycles() == [], "modules of the pack import each other (in a cycle): break it"


def test_cycle_checker_sees_an_import_hidden_in_importlib_and_skips_type_checking_imports(tmp_path):
    """The cycle merge/registry.py once had: it loaded merge/methods/ by importlib.import_module, and
    the methods import the registry. An import under ``if TYPE_CHECKING`` is no edge."""
    files = {
        "merge/__init__.py": "",
        "merge/registry.py": "import importlib\nimportlib.import_module('.methods', __package__)\n",
        "merge/methods/__init__.py": "from . import linear\n",
        "merge/methods/linear.py": "from ..registry import merge_method\n",
        "patcher/__init__.py": "",
        "patcher/state.py": "import typing\nif typing.TYPE_CHECKING:\n    from .events import T\n",
        "patcher/events.py": "from .state import S\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    paths = [tmp_path / name for name in files]
    assert import_cycles(tmp_path, paths) == [["merge.methods", "merge.methods.linear", "merge.registry"]]


def test_library_packages_share_no_module_name():
    """hooks/, patcher/ and merge/ name each module once among them (issue 32: ``plan.py``, ``steps.py`` and
    ``cache.py`` once meant different things in two packages), so a module's name says which it is.
    nodes/ may mirror a library module it gives nodes to (nodes/floats.py for hooks/floats.py)."""
    owners: dict[str, list[str]] = {}
    for package in ("hooks", "patcher", "merge"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py":
                owners.setdefault(path.stem, []).append(path.relative_to(ROOT).as_posix())
    shared = {name: paths for name, paths in owners.items() if len(paths) > 1}
    assert not shared, f"rename one of each: {shared}"


NODE_HELPERS = {"__init__", "v3", "search_terms", "lora_files"}  # registration, V3 conventions, search words,
# and the LoRA-reading nodes' base class with the files it keeps per node


def defines_nodes(path: Path) -> bool:
    """Whether ``path`` ends with the one registration path, a top-level ``NODES`` list: of classes it
    defines when the list is written out (merge_methods.py generates its classes)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "NODES" for t in targets):
            if not isinstance(node.value, ast.List):
                return True
            return bool(node.value.elts) and all(isinstance(e, ast.Name) and e.id in classes
                                                 for e in node.value.elts)
    return False


def test_nodes_holds_node_classes_only():
    """Issue 32 item 4: every module of nodes/ but its helpers (``NODE_HELPERS``) defines nodes; the merge
    nodes' ComfyUI adapters (resolver, progress, interrupt, cache, state-dict writing, tensor work) are
    comfy_merge/'s, which never imports nodes/."""
    others = sorted(p.name for p in (ROOT / "nodes").glob("*.py")
                    if p.stem not in NODE_HELPERS and not defines_nodes(p))
    assert others == [], f"nodes/ holds node classes only: move {others} to a library or comfy_merge/"
    assert {p.stem for p in (ROOT / "nodes").glob("*.py")} >= NODE_HELPERS - {"lora_files"}


def test_node_check_and_adapter_arrows_catch_their_breaks(tmp_path):
    """The checks themselves: a module of helpers without NODES is reported, a written-out NODES of a class
    from elsewhere too; a comfy_merge/ module importing nodes/ or the patcher is refused."""
    (tmp_path / "helpers.py").write_text("def resolve(path):\n    return path\n")
    (tmp_path / "borrowed.py").write_text("from .other import Node\nNODES = [Node]\n")
    (tmp_path / "real.py").write_text("class Node:\n    pass\n\n\nNODES = [Node]\n")
    found = [defines_nodes(tmp_path / f"{name}.py") for name in ("helpers", "borrowed", "real")]
    assert found == [False, False, True]
    (tmp_path / "comfy_merge").mkdir()
    adapter = tmp_path / "comfy_merge" / "bad.py"
    adapter.write_text("from ..nodes import v3\nfrom ..patcher import registry\nfrom ..merge import recipe\n"
                       "import folder_paths\nimport server\n")
    targets = {t for _, t in imported_targets(adapter, root=tmp_path)}
    assert targets & FORBIDDEN["comfy_merge"] == {"nodes", "patcher", "server"}

"""The package's import graph: every import between parts runs down the layers, and no module imports itself
back through others."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "p2pkv"

# Low to high: a part may import only parts of a lower layer. The proxy, which runs apart from vLLM, sits beside
# the vLLM side and imports neither the engine nor the KV planes.
LAYERS: list[set[str]] = [
    {"__init__", "errors", "hostaddr"},
    {"params", "tinymodel", "weights", "way"},
    {"config", "models", "protocol"},
    {"integrity"},
    {"memory", "transport"},
    {"engine"},
    {"kv", "discovery"},
    {"vllm", "proxy"},
    {"bench"},
    {"cli"},
    {"__main__"},
]
NEVER = {"proxy": {"engine", "kv", "vllm", "memory", "transport"}}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "p2pkv":
            # `from p2pkv.x import y`: the module y where there is one, else the names of p2pkv.x
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists()
                found.add(sub if is_module else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "p2pkv")
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def test_every_part_has_a_layer() -> None:
    parts = {_part(_module(p)) for p in PACKAGE.rglob("*.py")}
    assert parts <= set().union(*LAYERS), parts - set().union(*LAYERS)


def test_imports_between_parts_run_down_the_layers() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _part(_module(path))
        for target in _imports(path, top_level_only=False):
            there = _part(target)
            if there == here:
                continue
            if _rank(there) >= _rank(here) or there in NEVER.get(here, set()):
                upward.append(f"{_module(path)} -> {target}")
    assert not upward, upward


def test_no_module_imports_itself_back_at_load_time() -> None:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {t for t in _imports(path, top_level_only=True) if t in modules and t != name}
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return [*path, name, nxt]
            if nxt not in state and (circle := visit(nxt, [*path, name])) is not None:
                return circle
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            assert (circle := visit(name, [])) is None, " -> ".join(circle)

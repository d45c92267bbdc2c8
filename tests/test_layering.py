"""The package's layers import one way: loader < models < cache < engine < server < cli.

Every import statement counts, those inside functions too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import deltaserve

PACKAGE = Path(deltaserve.__file__).resolve().parent

# Rank of each top-level module or subpackage of deltaserve; a module may import ranks up to its own.
# tokenizer, errors and the kernels sit below everything; bench and train are tools over the server.
RANKS = {
    "errors": 0, "tokenizer": 0, "chat_template": 0, "callforms": 0, "ops": 0, "data": 0, "strings": 0, "bpe": 0,
    "loader": 1,
    "models": 2,
    "cache": 3, "convert": 3,  # convert writes what models read
    "dist": 3,  # a model spread over processes: built from models, run by the engine as if it were local
    "engine": 4,
    "": 4,  # the package itself: `deltaserve.LLM` is the engine's
    "server": 5,
    "bench": 6, "train": 6, "train_chat": 6,
    "cli": 7, "__main__": 7, "chat": 7,
}

KNOWN: set[str] = set()  # violations allowed for now: none


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool) -> set[str]:
    """Absolute names of the deltaserve modules (or packages) that `source`, the text of `module`, imports."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            # `from deltaserve import engine` imports the subpackage, not just the package
            names.update(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base
                         for alias in node.names)
    return {n for n in names if n == "deltaserve" or n.startswith("deltaserve.")}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer(name: str) -> str:
    """The top-level part of deltaserve a module belongs to ("" for the package itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    mine = RANKS[layer(module)]
    return sorted(f"{module} imports {target}" for target in imported(source, module, is_package)
                  if RANKS[layer(target)] > mine)


def test_every_part_of_the_package_has_a_rank():
    parts = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    parts |= {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert parts - {"__init__"} <= set(RANKS), "give new modules a rank in RANKS"


def test_no_module_imports_a_layer_above_it():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += violations(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")
    assert sorted(set(found) - KNOWN) == []
    assert sorted(KNOWN - set(found)) == [], "fixed: remove these from KNOWN"


def test_the_check_sees_absolute_relative_and_lazy_imports():
    """The checker itself, on imports that break the order."""
    assert violations("from deltaserve.engine.sampling import filter_logits", "deltaserve.cache.speculative") \
        == ["deltaserve.cache.speculative imports deltaserve.engine.sampling"]
    assert violations("def f():\n    from deltaserve.server.app import create_app", "deltaserve.engine.llm") \
        == ["deltaserve.engine.llm imports deltaserve.server.app"]
    assert violations("from ..engine import runner", "deltaserve.cache.manager") \
        == ["deltaserve.cache.manager imports deltaserve.engine.runner"]
    assert violations("from deltaserve import engine", "deltaserve.models", is_package=True) \
        == ["deltaserve.models imports deltaserve.engine"]
    assert violations("from . import state\nimport deltaserve.loader.memory", "deltaserve.cache", is_package=True) \
        == []
    assert violations("from deltaserve.server.app import create_app", "deltaserve.cli") == []

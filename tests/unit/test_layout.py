"""The package layout's rules (docs/architecture.md, "Processes and packages"):
what each process imports, and no import cycles between modules."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tierstore"


def loaded_by(statement: str) -> set[str]:
    """The tierstore modules (and lmdb) a fresh interpreter loads for ``statement``."""
    code = (
        f"{statement}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith('tierstore') or m == 'lmdb')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_engine_side_loads_no_store_sidecar_or_lmdb() -> None:
    mods = loaded_by("import tierstore.client")
    assert "lmdb" not in mods
    assert not {m for m in mods if m.startswith(("tierstore.store", "tierstore.sidecar"))}
    assert not {m for m in mods if m.startswith(("tierstore.peer", "tierstore.router"))}


def test_the_hf_adapter_loads_only_the_engine_side() -> None:
    mods = loaded_by("import tierstore.engines.hf")
    assert "lmdb" not in mods
    assert not {m for m in mods if m.startswith(("tierstore.store", "tierstore.sidecar"))}


def test_the_sglang_backends_pure_modules_load_neither_sglang_nor_the_store() -> None:
    mods = loaded_by("import tierstore.engines.sglang.layout, tierstore.engines.sglang.pages")
    assert not {m for m in mods if m == "sglang" or m.startswith("sglang.")}
    assert "lmdb" not in mods
    assert not {m for m in mods if m.startswith(("tierstore.store", "tierstore.sidecar"))}


def test_the_router_loads_only_the_peer_client_auth_and_membership() -> None:
    mods = loaded_by("import tierstore.router.service, tierstore.router.router")
    assert "lmdb" not in mods
    assert not {m for m in mods if m.startswith(("tierstore.store", "tierstore.sidecar"))}
    peer = {m for m in mods if m.startswith("tierstore.peer.")}
    assert peer <= {"tierstore.peer.client", "tierstore.peer.clients", "tierstore.peer.auth"}, peer


def test_membership_loads_nothing_of_the_peer_tier_store_or_sidecar() -> None:
    mods = loaded_by("import tierstore.membership.etcd, tierstore.membership.members")
    assert "lmdb" not in mods
    assert not {m for m in mods if m.startswith(("tierstore.store", "tierstore.sidecar"))}
    assert not {m for m in mods if m.startswith(("tierstore.peer", "tierstore.router"))}


def test_the_gateway_loads_no_engine_torch_store_or_sidecar() -> None:
    """The gateway runs where no engine is installed (``tierstore[gateway]``)."""
    code = (
        "import sys, tierstore.gateway.serve\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'vllm', 'sglang', 'transformers', 'lmdb')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "[]"
    mods = loaded_by("import tierstore.gateway.serve")
    assert not {m for m in mods if m.startswith(("tierstore.store", "tierstore.sidecar"))}
    peer = {m for m in mods if m.startswith("tierstore.peer.")}
    assert peer <= {"tierstore.peer.client", "tierstore.peer.clients", "tierstore.peer.auth"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of ours that ``path`` imports when it is loaded: top-level
    statements only (imports inside functions and under TYPE_CHECKING run later
    or never)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    return {m for m in found if m in modules}


def test_no_import_cycles_between_modules() -> None:
    files = [p for p in PACKAGE.rglob("*.py") if "v1" not in p.parts]
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): _load_time_imports(p, modules) for p in files}
    for mod, deps in graph.items():
        # A package's __init__ importing its own submodules is loading, not a cycle.
        graph[mod] = {d for d in deps if not d.startswith(mod + ".")}
    # A submodule importing a name re-exported by its package's __init__ needs
    # the package, which needs the submodule: count that as a cycle too.
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(mod: str) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                walk(dep)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            walk(mod)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", ["tierstore.client", "tierstore.keys"])
def test_public_imports_engines_rely_on(name: str) -> None:
    mods = loaded_by(
        "from tierstore.client import StoreClient\nfrom tierstore.keys import KVLayout, chain_keys"
    )
    assert name in mods

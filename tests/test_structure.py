"""The package's structure, read from the source tree as it lies on disk: one-way layers, no
import cycles, relative imports inside the package, and the facade a user imports from.

The layers, bottom up (docs/architecture.md):

0. the pool: geometry, descriptors, sizing, the pool (``plugin/``, its ``sglang/`` and ``vllm/``
   excepted);
1. the transfer core: planning, protocol, engines, control plane, nodes (``transfer/``, its
   ``launcher/`` and ``bench/`` excepted);
2. the integrations and tools: the SGLang adapter (``plugin/sglang/``), the vLLM connector
   (``plugin/vllm/``), the launcher (``transfer/launcher/``) and the bench (``transfer/bench/``).

A module may import its own layer or one below, never one above. Inside each node's package the
work flows one way: the units a node hands work to (the writer, the reporter, the verifier, the
scatter, a request's own object) never import the node or its request book, which submit it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"plugin": "dsa_bridge.plugin", "transfer": "dsa_bridge.transfer"}
TOP = ("dsa_bridge.plugin.sglang", "dsa_bridge.plugin.vllm", "dsa_bridge.transfer.launcher",
       "dsa_bridge.transfer.bench")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [*PACKAGES[rel.parts[0]].split("."), *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(path): path
    for folder in PACKAGES
    for path in sorted((ROOT / folder).rglob("*.py"))
}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def layer(name: str) -> int:
    if any(name == top or name.startswith(top + ".") for top in TOP):
        return 2
    return 1 if name.startswith("dsa_bridge.transfer") else 0


def imports_of(name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, written absolute) for each import of a dsa_bridge module."""
    package = name if is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, True) for a in node.names if a.name.startswith("dsa_bridge")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("dsa_bridge"):
                target = node.module
            else:
                continue
            # ``from PKG import submodule`` imports the submodule, not only the package
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found += [(t, node.lineno, not node.level) for t in subs or [target]]
    return found


def edges() -> dict[str, set[str]]:
    return {name: {t for t, _, _ in imports_of(name) if t in MODULES} for name in MODULES}


def test_the_tree_is_read():
    assert "dsa_bridge.transfer.prefill" in MODULES and "dsa_bridge.plugin.pool" in MODULES
    assert "dsa_bridge.plugin.pool" in edges()["dsa_bridge.plugin.sglang.pool"]
    assert len(MODULES) > 40


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_inside_the_package_are_relative_and_resolve(name):
    for target, line, absolute in imports_of(name):
        where = f"{MODULES[name].relative_to(ROOT)}:{line}"
        assert not absolute, f"{where} imports {target} by its absolute name; import it relatively"
        assert target in MODULES, f"{where} imports {target}, which is not in the source tree"


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
        for name, targets in edges().items()
        for target in targets
        if layer(target) > layer(name)
    ]
    assert upward == []


SUBMITTERS = ("dsa_bridge.transfer.prefill.node", "dsa_bridge.transfer.prefill.requests",
              "dsa_bridge.transfer.decode.node")
WORKERS = ("dsa_bridge.transfer.prefill.writer", "dsa_bridge.transfer.prefill.outcomes",
           "dsa_bridge.transfer.prefill.prefill_request", "dsa_bridge.transfer.prefill.stager",
           "dsa_bridge.transfer.prefill.checksums", "dsa_bridge.transfer.decode.verify",
           "dsa_bridge.transfer.decode.scatter", "dsa_bridge.transfer.decode.receiver",
           "dsa_bridge.transfer.decode.job_thread")


def test_work_handed_forward_never_imports_who_submitted_it():
    graph = edges()
    assert set(SUBMITTERS + WORKERS) <= set(graph), "a named module is gone: update the lists"
    back = [f"{worker} imports {target}" for worker in WORKERS for target in graph[worker]
            if target in SUBMITTERS]
    assert back == []


def test_no_import_cycles():
    graph = edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_transfer_facade_exports_what_a_user_needs():
    import dsa_bridge.transfer as transfer

    for name in ("PrefillNode", "DecodeNode", "KVSender", "KVReceiver", "create_backend", "KVPoll",
                 "HandshakeError", "BackendError", "TransferFailed"):
        assert name in transfer.__all__ and getattr(transfer, name) is not None, name
    for name in transfer.__all__:  # each resolves from its module, lazily
        assert getattr(transfer, name) is getattr(importlib.import_module(transfer.EXPORTS[name],
                                                                          "dsa_bridge.transfer"), name)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        transfer.Nope  # noqa: B018


@pytest.mark.parametrize("name, path", [("PrefillNode", "transfer/prefill/node.py"),
                                        ("DecodeNode", "transfer/decode/node.py")])
def test_each_node_class_stays_a_coordinator(name, path):
    """A node coordinates the units of its package; its concerns live in them (at most 250
    lines, docs/architecture.md's reading path)."""
    tree = ast.parse((ROOT / path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    assert node.end_lineno - node.lineno + 1 <= 250


# tests/ mirrors the code: each folder of tests is named after the code it tests, or is one of the
# tiers that run the nodes as OS processes.
TEST_FOLDERS = {
    "pool": "plugin",  # the pool, its layout, descriptors and sizing (plugin/'s own modules)
    "transfer": "transfer",  # the transfer core's own modules, and both nodes together in-process
    "prefill": "transfer/prefill",
    "decode": "transfer/decode",
    "backends": "transfer/backends",
    "launcher": "transfer/launcher",
    "bench": "transfer/bench",
    "sglang": "plugin/sglang",
    "vllm": "plugin/vllm",
    "gpu": None,  # the CUDA path, each test's cpu variant in the main suite
    "integration": None,  # prefill and decode as separate processes
    "reliability": None,  # faults, floods, freezes and namespaces against processes
}


def test_the_test_folders_are_named_after_the_code():
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(TEST_FOLDERS)
    for folder, code in TEST_FOLDERS.items():
        assert code is None or (ROOT / code).is_dir(), (folder, code)


def test_no_two_test_files_share_a_name():
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []

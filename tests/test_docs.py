"""The docs name only what exists: every code-like name in a backticked span of README.md and
docs/*.md is found in the code, or is a foreign name in ``FOREIGN``.

Read from the source tree as text, nothing imported. In each span (fenced blocks are commands and
listings, left out) the test picks out:

- file and folder paths (``transfer/plan.py``, ``tests/sglang/``, a bare ``test_decode_fence.py``), with
  an optional ``::test_name`` (a trailing ``*`` matches any ending): the file exists in the tree,
  the test is defined in it;
- command-line flags (``--chunk-pages``): written in the code (``--no-x`` where ``--x`` is);
- identifiers that look like code — with ``_``, dotted (``PrefillNode.incoming``), called
  (``poll()``) or CamelCase (``DecodeNode``): each part is a word of the code; a dotted path
  from ``dsa_bridge`` names a module that exists; a metric ``dsa_bridge_x_total`` is found as
  ``dsa_bridge_x`` or as ``x``; a name cut by ``…`` / ``...`` / ``*`` matches any word it is
  the end or the start of.

The code is the text of plugin/, transfer/, tests/ (this file left out), .ci/ and pyproject.toml:
a name still found only in a comment passes, so keep comments true too. On failure every missing
name is listed as ``file:line: name (in `span`)``: rename it in the doc, or, when the doc means a
name of SGLang, Mooncake, NIXL, torch or the system, add it to ``FOREIGN`` under its owner.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCE_DIRS = ("plugin", "transfer", "tests", ".ci", "scripts")
SOURCE_SUFFIXES = {".py", ".toml", ".json", ""}  # "": the .ci scripts
PACKAGES = {"dsa_bridge.plugin": "plugin", "dsa_bridge.transfer": "transfer"}

# Names the docs cite that are not ours and that our code does not mention, by owner (what our
# code mentions passes anyway). A dotted name is foreign when its first part is one of
# FOREIGN_ROOTS, an environment variable when it starts with one of FOREIGN_ENV.
FOREIGN_ROOTS = {"sglang", "torch", "np", "numpy", "mooncake", "glibc", "vllm"}
FOREIGN_ENV = ("MC_", "UCX_", "NIXL_", "SGLANG_", "GLIBC_", "OMP_")
FOREIGN = {
    # SGLang 0.5.23: classes, attributes, files, server flags
    "index_put", "prefill_complete",
    "--disaggregation-enable-kv-checksum", "--disaggregation-mode", "--disaggregation-transfer-backend",
    # vLLM 0.32.0: connector API, config keys
    "SupportsHMA", "kv_buffer_device",
    # a Hugging Face model's config file
    "config.json",
    # Mooncake transfer engine 0.3.13
    "TransferNotify", "enable_listen_thread", "engine.so", "transfer_metadata.cpp",
    # NIXL 1.5.1
    "notif_msg",
    # the system: glibc, the kernel, sockets
    "x86_non_temporal_threshold", "rtnl_tc_unregister", "in6addr_any",
}

PATH = re.compile(r"(?<![\w.:/-])((?:\.?[\w*-]+/)+[\w.*-]*|[\w*-]+\.(?:py|md|toml|json|png|so|cpp))"
                  r"(?:::([\w*]+))?")
TEST_ID = re.compile(r"(?<![\w/])::([\w*]+)")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
NAME = re.compile(r"(\.\.\.|…)?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(\)?|\.\.\.|…|\*)?")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
CAMEL = re.compile(r"[a-z][A-Z]|[A-Z]{2}[a-z]")
SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def source_files() -> list[Path]:
    """The text the docs' names are looked up in (this file's allow-list left out)."""
    files = [ROOT / "pyproject.toml"]
    for folder in SOURCE_DIRS:
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file()
                  and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts
                  and p != Path(__file__).resolve()]
    return files


TEXT = {p: p.read_text(errors="replace") for p in source_files()}
WORDS = {w for text in TEXT.values() for w in re.findall(r"\w+", text)}
FLAGS = {f for text in TEXT.values() for f in FLAG.findall(text)}


def tree() -> list[Path]:
    """Every file and folder of the project (virtual environments, git and caches left out)."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith((".venv", ".git", "__pycache__"))]
        found += [Path(folder, name) for name in (*subfolders, *files)]
    return found


TREE = tree()


def spans(doc: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span of ``doc``, fenced blocks blanked out."""
    lines, fenced = [], False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    text = "\n".join(lines)
    found = []
    for paragraph in re.finditer(r"(?:.+\n?)+", text):  # a span never crosses a blank line
        for m in SPAN.finditer(paragraph.group()):
            start = paragraph.start() + m.start()
            found.append((text.count("\n", 0, start) + 1, m.group(2).replace("\n", " ").strip()))
    return found


def word_like(word: str, before: str | None, after: str | None) -> bool:
    """``word`` is a word of the code; cut by ``…`` / ``*``: the end / start of one."""
    if word in WORDS:
        return True
    if before and after:
        return any(word in w for w in WORDS)
    if before:
        return any(w.endswith(word) or w == word.lstrip("_") for w in WORDS)
    if after in ("...", "…", "*"):
        return any(w.startswith(word) for w in WORDS)
    return False


def path_exists(path: str) -> Path | None:
    """The file or folder ``path`` names (from the root, or a bare file name anywhere)."""
    pattern = path.rstrip("/")
    if "/" in pattern:
        return next(iter(sorted(ROOT.glob(pattern))), None)
    return next((p for p in TREE if p.match(pattern)), None)


def missing_in_path(path: str, test: str | None) -> list[str]:
    """``[path]`` (or ``[path::test]``) unless the file exists (and defines the test)."""
    if path in FOREIGN or path.startswith(("/", "http")):
        return []
    if not path.endswith(("/", ".py", ".md", ".toml", ".json", ".png", ".so", ".cpp")) and \
            path.split("/")[0] not in (*SOURCE_DIRS, "docs"):  # not a path: a/b shorthand, a string
        return [part for part in path.split("/")
                if IDENTIFIER.fullmatch(part) and code_like(part, None) and not known(part)]
    found = path_exists(path)
    if found is None and "." in path.rpartition("/")[2]:  # plugin/layout.index_layer_ids_for
        module, _, names = path.partition(".")
        source = ROOT / f"{module}.py"
        if source.is_file():
            words = set(re.findall(r"\w+", source.read_text()))
            return [] if all(name in words for name in names.split(".")) else [path]
    if found is None:
        return [path]
    if test and found.is_file():
        cut = test.endswith("*")
        name = test.rstrip("*")
        defined = re.findall(r"def (\w+)", found.read_text())
        if not any(d == name or (cut and d.startswith(name)) for d in defined):
            return [f"{path}::{test}"]
    return []


def module_rest(parts: list[str]) -> list[str] | None:
    """The parts after the longest dsa_bridge module ``parts`` starts with; None if none."""
    for cut in range(len(parts), 1, -1):
        dotted = ".".join(parts[:cut])
        for package, folder in PACKAGES.items():
            if dotted == package or dotted.startswith(package + "."):
                inner = dotted[len(package):].lstrip(".")
                rel = Path(folder, *inner.split(".")) if inner else Path(folder)
                if (ROOT / rel.with_suffix(".py")).is_file() or (ROOT / rel / "__init__.py").is_file():
                    return parts[cut:]
    return None


def known(name: str, before: str | None = None, after: str | None = None) -> bool:
    """A code-like identifier or dotted name is ours or foreign."""
    if name in FOREIGN or name.startswith(FOREIGN_ENV):
        return True
    parts = name.split(".")
    if parts[0] in FOREIGN_ROOTS or parts[0] in FOREIGN:
        return True
    if name == "dsa_bridge":
        return True
    if parts[0] == "dsa_bridge":
        rest = module_rest(parts)
        return rest is not None and all(p in WORDS for p in rest)
    metric = re.fullmatch(r"(dsa_bridge_|_)(\w+?)(_total)?", name)
    if metric and (before or metric.group(1) == "dsa_bridge_") and name not in WORDS:
        # a metric: its family is named dsa_bridge_x or f"dsa_bridge_{x}" (x), "_total" added
        return word_like(metric.group(2), before, None) or f"dsa_bridge_{metric.group(2)}" in WORDS
    return all(word_like(p, before if i == 0 else None, after if i == len(parts) - 1 else None)
               for i, p in enumerate(parts))


def code_like(name: str, after: str | None, alone: bool = False) -> bool:
    """With ``_`` or ``.``, called, CamelCase, or a capitalised word alone in its span (a class:
    ``Liveness``); not a plain word, nor an acronym (``DRAM``)."""
    return ("_" in name or "." in name or (after or "").startswith("(") or bool(CAMEL.search(name))
            or (alone and name[0].isupper() and not name.isupper()))


def missing_names(span: str) -> list[str]:
    """The names of one span the code does not have."""
    missing = []
    for m in PATH.finditer(span):
        missing += missing_in_path(m.group(1), m.group(2))
    rest = PATH.sub(" ", span)
    for m in TEST_ID.finditer(rest):
        if not word_like(m.group(1).rstrip("*"), None, "*" if m.group(1).endswith("*") else None):
            missing.append(f"::{m.group(1)}")
    rest = TEST_ID.sub(" ", rest)
    for flag in FLAG.findall(rest):
        if flag not in FLAGS and flag not in FOREIGN and flag.replace("--no-", "--", 1) not in FLAGS:
            missing.append(flag)
    rest = FLAG.sub(" ", rest)
    alone = IDENTIFIER.fullmatch(span) is not None
    for m in NAME.finditer(rest):
        before, name, after = m.groups()
        if code_like(name, after, alone) and not known(name, before, after):
            absent = [part for part in name.split(".") if part not in WORDS]
            cited = f"{before or ''}{name}"
            missing.append(cited if absent in ([], [name]) else f"{cited} (not found: {', '.join(absent)})")
    return missing


def test_every_name_the_docs_cite_exists():
    """One line per missing name, ``doc:line: name   (in `span`)``, all of them at once."""
    problems = [
        f"{doc.relative_to(ROOT)}:{line}: {name}   (in `{span}`)"
        for doc in DOCS
        for line, span in spans(doc)
        for name in missing_names(span)
    ]
    if problems:
        pytest.fail(f"{len(problems)} names in the docs are not in the code (rename them in the doc, "
                    "or add a foreign name to FOREIGN in tests/test_docs.py):\n" + "\n".join(problems),
                    pytrace=False)


def test_every_foreign_name_is_still_cited():
    """``FOREIGN`` lists only what some doc still names: the allow-list stays short and true."""
    docs = "\n".join(doc.read_text() for doc in DOCS)
    unused = sorted(name for name in (*FOREIGN, *FOREIGN_ROOTS) if name not in docs)
    assert not unused, f"no doc names these any more; remove them from FOREIGN: {unused}"

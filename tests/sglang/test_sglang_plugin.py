"""The sglang plugin (``plugin/sglang/hooks.py``): discovered from the installed metadata by
sglang's own ``load_plugins()``, active only where ``SGLANG_PLUGINS`` names it, and then the DSA
pool sglang's configurator builds is dsa-bridge's subclass. Each case runs in its own process:
``load_plugins`` runs once per process and patches sglang's modules, as in a scheduler."""

from __future__ import annotations

import json
import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from .. import forkserver
from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, logging
import tests.sglang.conftest  # the shims
logging.basicConfig(level=logging.INFO)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache import kv_cache_configurator
configurator = object.__new__(KVCacheConfigurator)
dsa = configurator._resolve_kv_pool_class(kind="dsa", default=DSATokenToKVPool)
mla = configurator._resolve_kv_pool_class(kind="mla", default=MLATokenToKVPool)
print("RESULT " + json.dumps({
    "dsa": dsa.__module__ + "." + dsa.__qualname__,
    "mla": mla.__module__ + "." + mla.__qualname__,
    "dsa_is_subclass": issubclass(dsa, DSATokenToKVPool),
    "name_still_sglangs": kv_cache_configurator.DSATokenToKVPool is DSATokenToKVPool
        and DSATokenToKVPool.__module__ == "sglang.srt.mem_cache.memory_pool",
    "hook_sources": sorted({src.plugin_name for hooks in HookRegistry._hooks.values()
                            for _, _, src in hooks if src is not None}),
}))
"""


def probe(plugins: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    out = forkserver.run(["-c", PROBE], env, str(ROOT), timeout_s=240)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "log": out.stderr}


def test_entry_point_is_in_the_installed_metadata():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dsa_bridge"]
    assert ep.value == "dsa_bridge.plugin.sglang.hooks:register"
    assert ep.dist.name == "dsa-bridge"


def test_load_plugins_named_dsa_bridge_builds_dsa_bridge_pool_for_dsa_only():
    got = probe("dsa_bridge")
    assert got["dsa"] == "dsa_bridge.plugin.sglang.pool.BridgeDSATokenToKVPool"
    assert got["dsa_is_subclass"] and got["name_still_sglangs"]
    assert got["mla"] == "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool"
    assert got["hook_sources"] == ["dsa_bridge"]
    assert "Executed general plugin: dsa_bridge" in got["log"]


@pytest.mark.parametrize(("plugins", "said"), [
    (None, "dsa-bridge: installed but not named in SGLANG_PLUGINS; no hook registered"),
    ("some_other_plugin", "Skipping plugin dsa_bridge (not in SGLANG_PLUGINS)"),
])
def test_installed_but_not_named_changes_nothing(plugins, said):
    got = probe(plugins)
    assert got["dsa"] == "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool"
    assert got["hook_sources"] == []
    assert said in got["log"]

"""The sglang plugin (entry point ``dsa_bridge`` in the group ``sglang.srt.plugins``).

sglang's ``load_plugins()`` calls ``register`` at the start of every scheduler process (and in
the engine's main process, where the bootstrap server starts). It is opt-in twice over:
installed, it does nothing unless ``SGLANG_PLUGINS`` names ``dsa_bridge`` (sglang loads every
installed plugin when that variable is empty). Named, it registers two ``HookRegistry`` AROUND
hooks:

- on sglang's pool-class resolution (``KVCacheConfigurator._resolve_kv_pool_class``): where
  sglang would build its in-tree ``DSATokenToKVPool``, it builds ``BridgeDSATokenToKVPool``, a
  subclass. The name ``DSATokenToKVPool`` keeps meaning sglang's class, so every isinstance check
  in sglang — its other DSA pool subclasses included — is unchanged; a platform's own pool class
  is kept.
- on ``sglang.srt.disaggregation.utils.get_kv_class``: for the ``mooncake`` and ``nixl``
  backends, the manager, sender, receiver and bootstrap server are dsa-bridge's
  (``conn``); other backends and ``KVArgs`` are sglang's. ``get_kv_class`` is called
  with the backend only — it cannot know the model — so the choice per model is made where the
  model shows: dsa-bridge's manager takes KVArgs whose only state is sglang's DSA indexer
  (``StateType.DSA``, which sglang's ``setup_state_kv_args`` publishes for its DSA pools) and
  builds sglang's own manager of that backend for anything else; senders and receivers follow
  their manager.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PLUGIN_NAME = "dsa_bridge"
POOL_CLASS_RESOLVER = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class"
)
KV_CLASS_RESOLVER = "sglang.srt.disaggregation.utils.get_kv_class"
BRIDGED_BACKENDS = ("mooncake", "nixl")


def named_in_sglang_plugins() -> bool:
    """True when ``SGLANG_PLUGINS`` (comma-separated) names this plugin."""
    from sglang.srt.environ import envs

    return PLUGIN_NAME in {name.strip() for name in (envs.SGLANG_PLUGINS.get() or "").split(",")}


def dsa_pool_class(original, configurator, *, kind: str, default: type) -> type:
    """AROUND ``_resolve_kv_pool_class``: dsa-bridge's pool where sglang would use its in-tree
    DSA pool; anything else (other kinds, a platform's class) unchanged."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from .pool import BridgeDSATokenToKVPool

    chosen = original(configurator, kind=kind, default=default)
    if kind != "dsa" or chosen is not DSATokenToKVPool:
        if kind == "dsa":
            log.warning("dsa-bridge: sglang chose %s for the DSA pool; kept (dsa-bridge's pool not used)",
                        getattr(chosen, "__qualname__", chosen))
        return chosen
    log.info("dsa-bridge: the DSA pool is %s", BridgeDSATokenToKVPool.__qualname__)
    return BridgeDSATokenToKVPool


def dsa_bridge_kv_class(original, transfer_backend, class_type):
    """AROUND ``get_kv_class``: dsa-bridge's classes for the Mooncake and NIXL backends (each
    manager decides per model, see the module docstring); anything else sglang's."""
    from . import conn

    chosen = conn.CLASSES.get(getattr(class_type, "value", class_type))
    if chosen is None or getattr(transfer_backend, "value", transfer_backend) not in BRIDGED_BACKENDS:
        return original(transfer_backend, class_type)
    return chosen


def register() -> None:
    """sglang's entry point: register the hooks, or nothing unless SGLANG_PLUGINS names us."""
    if not named_in_sglang_plugins():
        log.info("dsa-bridge: installed but not named in SGLANG_PLUGINS; no hook registered")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(POOL_CLASS_RESOLVER, dsa_pool_class, HookType.AROUND)
    HookRegistry.register(KV_CLASS_RESOLVER, dsa_bridge_kv_class, HookType.AROUND)

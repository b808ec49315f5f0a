"""The sglang plugin (entry point ``dsa_bridge`` in the group ``sglang.srt.plugins``).

sglang's ``load_plugins()`` calls ``register`` at the start of every scheduler process (and in
the engine's main process, where the bootstrap server starts). It is opt-in twice over:
installed, it does nothing unless ``SGLANG_PLUGINS`` names ``dsa_bridge`` (sglang loads every
installed plugin when that variable is empty). Named, it registers three ``HookRegistry`` AROUND
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
  their manager;
- on sglang's start of its shared Mooncake engine in every scheduler process
  (``maybe_init_shared_mooncake_transfer_engine``, distributed/bootstrap.py): not started where PD
  transfer over Mooncake is its only user (``mooncake_only_for_pd``), so a process runs one
  engine, dsa-bridge's manager's; where dsa-bridge hands a pool to sglang's own Mooncake manager,
  that engine is started then (``rank_engine.sglang_mooncake_engine``). Its other users (HiCache's Mooncake
  store, encoder transfer, elastic EP) start it as sglang does.

And one AFTER hook on sglang's ``DecodePreallocQueue.__init__`` (where the decode's manager is
made, its transfer queue given): where that manager is dsa-bridge's, the transfer queue's
deferred-release deadline becomes the manager's one release bound (``release_bound.py``),
stated once; sglang reads its own variable earlier, in its transfer queue's ``__init__``.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PLUGIN_NAME = "dsa_bridge"
POOL_CLASS_RESOLVER = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class"
)
KV_CLASS_RESOLVER = "sglang.srt.disaggregation.utils.get_kv_class"
SHARED_ENGINE_START = ("sglang.srt.distributed.device_communicators.mooncake_transfer_engine."
                       "maybe_init_shared_mooncake_transfer_engine")
PREALLOC_QUEUE_INIT = "sglang.srt.disaggregation.decode.DecodePreallocQueue.__init__"
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


def mooncake_only_for_pd() -> bool:
    """Whether sglang's shared Mooncake engine would serve PD transfer only (its other users, as
    sglang 0.5.23's ``maybe_init_shared_mooncake_transfer_engine`` lists them, all off)."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_disagg, get_exec, get_memory

    disagg, memory, moe = get_disagg(), get_memory(), get_exec().moe
    pd = disagg.disaggregation_mode != "null" and disagg.disaggregation_transfer_backend == "mooncake"
    others = ((memory.enable_hierarchical_cache and memory.hicache_storage_backend == "mooncake"
               and envs.SGLANG_HICACHE_MOONCAKE_REUSE_TE.get())
              or ((disagg.encoder_only or disagg.language_only)
                  and disagg.encoder_transfer_backend == "mooncake")
              or (moe.enable_elastic_expert_backup and moe.elastic_ep_backend is not None)
              or moe.elastic_ep_backend == "mooncake")
    return pd and not others


def one_engine(original, *args, **kwargs):
    """AROUND sglang's start of its shared Mooncake engine: skipped where only PD transfer would
    use it (dsa-bridge's manager runs the process's one engine); started otherwise."""
    if mooncake_only_for_pd():
        log.info("dsa-bridge: sglang's shared Mooncake engine not started: dsa-bridge's manager runs "
                 "this process's one engine (sglang's is started if its own manager takes a pool)")
        return None
    return original(*args, **kwargs)


def one_release_bound(result, queue, *args, **kwargs) -> None:
    """AFTER ``DecodePreallocQueue.__init__``: sglang's transfer queue holds a failed request's
    pages for the manager's one bound (module docstring), where the manager is dsa-bridge's and
    sglang's deferral is on; else nothing changes."""
    from .manager import DSABridgeKVManager

    manager, transfer_queue = queue.kv_manager, queue.transfer_queue
    if not isinstance(manager, DSABridgeKVManager) or not transfer_queue.enable_deferred_kv_release:
        return
    transfer_queue.deferred_kv_release_timeout = manager.deferred_release.take_bound()
    log.info("dsa-bridge: %s", manager.release_bound.line())


def register() -> None:
    """sglang's entry point: register the hooks, or nothing unless SGLANG_PLUGINS names us."""
    if not named_in_sglang_plugins():
        log.info("dsa-bridge: installed but not named in SGLANG_PLUGINS; no hook registered")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(POOL_CLASS_RESOLVER, dsa_pool_class, HookType.AROUND)
    HookRegistry.register(KV_CLASS_RESOLVER, dsa_bridge_kv_class, HookType.AROUND)
    HookRegistry.register(SHARED_ENGINE_START, one_engine, HookType.AROUND)
    HookRegistry.register(PREALLOC_QUEUE_INIT, one_release_bound, HookType.AFTER)

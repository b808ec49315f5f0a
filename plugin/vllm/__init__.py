"""dsa_bridge.plugin.vllm: dsa-bridge inside vLLM, as a KV connector (docs/vllm.md).

vLLM loads it from its ``--kv-transfer-config``: ``"kv_connector": "DSABridgeConnector"``,
``"kv_connector_module_path": "dsa_bridge.plugin.vllm.connector"``. One role per module, as
vLLM's own NIXL connector package: ``connector`` (the facade vLLM instantiates for both roles),
``scheduler`` (its scheduler side), ``worker`` (its worker side: the dsa-bridge nodes),
``metadata`` (what the scheduler side tells the workers each step), ``options`` (the extra
config and the requests' ``kv_transfer_params``, pure) and ``caches`` (vLLM's cache tensors as a
dsa-bridge pool). Nothing here is imported by the core: vLLM is never its requirement.
"""

"""dsa_bridge.plugin.sglang: dsa-bridge inside SGLang, the top layer over the pool and the
transfer core.

``hooks.register`` is the entry point sglang's plugin loader runs (``SGLANG_PLUGINS=dsa_bridge``);
``pool`` is the DSA pool as sglang's subclass, ``kvargs`` turns sglang's ``KVArgs`` into buffers,
``conn`` holds the KV manager, sender, receiver and bootstrap server sglang drives.
"""

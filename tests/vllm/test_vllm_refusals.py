"""What the connector refuses inside the real vLLM, by name, before anything is registered: a
cache shape it does not serve (the MLA row vLLM allocated is none of dsa-bridge's), a prefill
without its control port, and more than one KV cache group (what vLLM's hybrid KV cache manager,
which vLLM turns off for the connector, would make)."""

from __future__ import annotations

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from .harness import MiniEngine, dsa_specs, write_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), layers=2)


def test_a_cache_shape_not_served_is_refused_naming_the_cache(model):
    with pytest.raises(ValueError, match=r"cache 'model.layers.0.self_attn.attn': 600 bytes per "
                                         "token is no MLA row dsa-bridge serves"):
        MiniEngine(model, "kv_consumer", {}, specs=dsa_specs(2, mla_row=600))


def test_a_prefill_without_a_port_is_refused(model):
    with pytest.raises(ValueError, match=r"\['port'\] is required on a prefill"):
        MiniEngine(model, "kv_producer", {"engine": "mooncake"})


def test_vllm_turns_its_hybrid_kv_cache_manager_off_for_the_connector(model):
    """The connector is not ``SupportsHMA``, so vLLM's own config turns the hybrid manager off
    (vLLM 0.32.0 does not refuse one turned on explicitly: the next test's refusal is then the
    connector's)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from dsa_bridge.plugin.vllm.connector import DSABridgeConnector

    from .harness import vllm_config

    assert not issubclass(DSABridgeConnector, SupportsHMA)
    assert vllm_config(model, "kv_consumer", {}).scheduler_config.disable_hybrid_kv_cache_manager is True


def test_more_than_one_kv_cache_group_is_refused_naming_the_count(model):
    """What the hybrid manager would make (one group per attention type) is refused by the
    connector itself, for both roles, before any cache is read."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from .harness import vllm_config

    specs = dsa_specs(2)
    names = list(specs)
    groups = [KVCacheGroupSpec(names[:2], specs[names[0]]), KVCacheGroupSpec(names[2:], specs[names[2]])]
    config = vllm_config(model, "kv_consumer", {})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="dsa-bridge serves one KV cache group .*vLLM made 2"):
            KVConnectorFactory.create_connector(config, role, KVCacheConfig(8, [], groups))

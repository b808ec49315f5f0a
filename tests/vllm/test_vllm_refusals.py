"""What the connector refuses inside the real vLLM, by name, before anything is registered: a
cache shape it does not serve (the MLA row vLLM allocated is none of dsa-bridge's), and a
prefill without its control port."""

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

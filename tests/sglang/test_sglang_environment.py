"""The SGLang tier's environment: the real sglang 0.5.23 next to the pinned CPU torch, and the
modules this tier uses importable through the shims of conftest.py (and only those)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)


def test_real_sglang_release_beside_the_pinned_cpu_torch():
    import sglang

    assert sglang.__version__ == "0.5.23"
    assert torch.__version__ == "2.13.0+cpu"
    assert not torch.cuda.is_available()


@pytest.mark.parametrize("module", [
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.base.conn",
    "sglang.srt.plugins",
    "sglang.srt.disaggregation.common.conn",  # the bootstrap server and sglang's connectors
    "sglang.srt.disaggregation.mooncake",
    "sglang.srt.disaggregation.nixl",
    "sglang.srt.disaggregation.prefill",  # the schedulers' KVArgs fill (_init_kv_manager)
    "sglang.srt.disaggregation.decode",
])
def test_the_sglang_modules_this_tier_uses_import(module):
    assert importlib.import_module(module).__name__ == module


def test_torchvision_is_only_the_stub_and_transformers_knows_it_is_absent():
    import sys

    from transformers.utils import import_utils

    if importlib.util.find_spec("torchvision").origin is not None:
        pytest.skip("a real torchvision is installed here; the stub is not used")
    assert sys.modules["torchvision"].__spec__.origin is None
    assert not import_utils.is_torchvision_available()

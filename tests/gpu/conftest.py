"""The GPU tier: each test body runs on the CPU here, in the normal suite (its ``cpu`` variant),
and on a CUDA device where there is one (its ``cuda`` variant, marked ``gpu``: ``-m gpu`` selects
it, and it skips with the reason where ``torch.cuda.is_available()`` is False). A test that needs
an engine skips where that engine is not installed (a GPU host may carry one engine per run:
``scripts/device-check``)."""

from __future__ import annotations

import pytest
import torch

from ..conftest import clear_engine_environment, require_engine

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
POOLS = {  # (model preset, kv dtype, indexer layout): the pools issue 31 names
    "deepseek-v3.2-fp8": ("deepseek-v3.2", "fp8", "uniform"),
    "deepseek-v3.2-bf16": ("deepseek-v3.2", "bf16", "uniform"),
    "glm-5.2-compact": ("glm-5.2", "fp8", "compact"),
}


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """"cpu", or "cuda:0" where torch sees a CUDA device (the variant skips elsewhere)."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device: torch.cuda.is_available() is False")
        return "cuda:0"
    return "cpu"


@pytest.fixture(params=["mooncake", "nixl"])
def engine(request, monkeypatch) -> str:
    require_engine(request.param)
    clear_engine_environment(monkeypatch)
    return request.param

"""The SGLang tier: tests against the real ``sglang==0.5.23`` package, on the CPU.

They run in ``.venv-sglang`` (``.ci/setup`` builds it); where ``import sglang`` fails (the main
``.venv``) every module here skips, naming the reason. The shims below stand in for GPU and
multimodal pieces that the tested paths import but never use (listed in docs/sglang.md):

- ``torchvision``: the index's wheel is built for a CUDA torch and does not load on the CPU
  build; SGLang imports it only from multimodal config code (``InterpolationMode``). Where it is
  missing, a stub module with that enum is installed, after transformers has cached that
  torchvision is unavailable (so transformers never tries the stub).
- ``torch.cuda.synchronize``: SGLang's DSA CPU-copy path calls it unconditionally; without a
  CUDA device it is a no-op here.
- a published ``ServerArgs`` runtime context (the ``sglang_context`` fixture, as SGLang's own
  ``published_topology`` test helper does): its pools read parallel widths from it.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch

from .. import forkserver


def _sglang_problem() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed here (the SGLang tier runs in .venv-sglang: see README)"
    return None


SGLANG_MISSING = _sglang_problem()
# what the rank processes' fork server imports once (``tests/forkserver.py``): the shims, then sglang
SGLANG_PRELOAD = ["tests.sglang.conftest", "sglang.srt.disaggregation.prefill",
                  "sglang.srt.disaggregation.decode", "sglang.srt.mem_cache.memory_pool",
                  "sglang.srt.plugins", "requests"]
if not SGLANG_MISSING:
    forkserver.preload(SGLANG_PRELOAD)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _stub_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()  # cached False before the stub exists
    modules = {name: types.ModuleType(name) for name in
               ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")}
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    modules["torchvision"].transforms = modules["torchvision.transforms"]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]
    modules["torchvision.transforms"].InterpolationMode = InterpolationMode
    modules["torchvision.transforms.functional"].InterpolationMode = InterpolationMode
    sys.modules.update(modules)


def _no_cuda_synchronize() -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None


if SGLANG_MISSING is None:
    _stub_torchvision()
    _no_cuda_synchronize()


@contextlib.contextmanager
def published_context(**server_args_fields):
    """SGLang's runtime context for one ``ServerArgs``, reset on exit (SGLang's own
    ``sglang.test.test_utils.published_topology``, which that module's imports keep out of
    reach here)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu", **server_args_fields)
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield server_args
    finally:
        reset_context()


@pytest.fixture
def sglang_context():
    with published_context() as server_args:
        yield server_args

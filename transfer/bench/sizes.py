"""What a ``dsa-bridge bench`` run measures: its request lengths, layer counts, concurrency and
repeats, per run size (``--quick``, the full run, and the tiny one the tests use)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """What one run measures (token counts are multiples of the 64-token page)."""

    repeat: int
    lengths: tuple[int, ...]  # DeepSeek-V3.2, all 61 layers
    long_lengths: tuple[int, ...]  # DeepSeek-V3.2 cut to long_layers layers (memory)
    long_layers: int
    layer_counts: tuple[int, ...]  # GLM-5.2 cut to this many layers, sweep_tokens a request
    concurrency: tuple[int, ...]  # requests in flight, concurrency_tokens each, DeepSeek-V3.2
    concurrency_tokens: int
    sweep_tokens: int  # the layer and page-pattern sweeps' request length; one of ``lengths``
    plan_lengths: tuple[int, ...]  # planning cost (address math only: no memory)
    pool_tokens: int  # tokens per pool operation (the docs report 8192: full and quick)
    # pages per descriptor of the route crossover sweep, from 2: one page per descriptor is the
    # descriptors sweep's per_page (runs_1 is the same page lists)
    crossover_runs: tuple[int, ...] = ()


SIZES = {
    "full": Sizes(repeat=9, lengths=(1024, 2048, 4096, 8192, 16384),
                  long_lengths=(1024, 4096, 16384, 32768, 65536, 131072), long_layers=8,
                  layer_counts=(1, 4, 16, 39, 78), concurrency=(1, 4, 16, 64),
                  concurrency_tokens=256, sweep_tokens=8192,
                  plan_lengths=(64, 1024, 4096, 16384, 65536, 131072), pool_tokens=8192,
                  crossover_runs=(2, 4, 8, 16)),
    "quick": Sizes(repeat=3, lengths=(1024, 8192, 16384), long_lengths=(131072,), long_layers=8,
                   layer_counts=(78,), concurrency=(1, 16, 64), concurrency_tokens=256,
                   sweep_tokens=8192, plan_lengths=(64, 8192, 131072), pool_tokens=8192,
                   crossover_runs=(2, 4, 8, 16)),
    "tiny": Sizes(repeat=1, lengths=(64, 256), long_lengths=(512,), long_layers=2,
                  layer_counts=(2,), concurrency=(1, 2), concurrency_tokens=64,
                  sweep_tokens=256, plan_lengths=(64, 1024), pool_tokens=256, crossover_runs=(2,)),
}

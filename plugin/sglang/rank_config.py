"""A scheduler rank's place in sglang's parallel layout, read once by the manager (pure).

``read_rank_config(parallel, kv_args)``: from sglang's published parallel config (what
``get_parallel()`` returns) and the rank's ``KVArgs`` (its pipeline stage and system DP rank,
which sglang sets there), the widths and ranks the manager registers and pairs by
(``RankConfig``); a missing or None stage or DP rank is 0, as sglang's own managers read them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankConfig:
    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    attn_cp_size: int
    attn_cp_rank: int
    pp_size: int
    pp_rank: int
    system_dp_size: int
    system_dp_rank: int
    layer_split: bool  # --enable-dsa-cache-layer-split: each CP rank holds its own layers
    kv_sharding: bool  # --enable-kv-cache-sharding
    cp_tp_group_sharing: bool


def read_rank_config(parallel, kv_args) -> RankConfig:
    """The rank's ``RankConfig`` (module docstring)."""
    return RankConfig(
        attn_tp_size=parallel.attn_tp_size, attn_tp_rank=parallel.attn_tp_rank,
        attn_dp_size=parallel.attn_dp_size, attn_dp_rank=parallel.attn_dp_rank,
        attn_cp_size=parallel.attn_cp_size, attn_cp_rank=parallel.attn_cp_rank,
        pp_size=parallel.pp_size, pp_rank=getattr(kv_args, "pp_rank", 0) or 0,
        system_dp_size=parallel.dp_size, system_dp_rank=getattr(kv_args, "system_dp_rank", 0) or 0,
        layer_split=bool(parallel.enable_dsa_cache_layer_split),
        kv_sharding=bool(parallel.enable_kv_cache_sharding),
        cp_tp_group_sharing=bool(parallel.enable_cp_tp_group_sharing))

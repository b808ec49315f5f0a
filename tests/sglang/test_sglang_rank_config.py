"""The manager's reader of a rank's place in sglang's parallel layout
(``plugin/sglang/rank_config.py``), alone: sglang's published parallel config, as a real
``ServerArgs`` publishes it, and the rank's ``KVArgs`` (its stage and system DP rank, 0 where
sglang leaves them unset or None)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .conftest import SGLANG_MISSING, published_context

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.runtime_context import get_parallel  # noqa: E402

from dsa_bridge.plugin.sglang.rank_config import RankConfig, read_rank_config  # noqa: E402


def test_a_published_layout_and_kvargs_give_the_rank():
    with published_context(tp_size=4, dp_size=2, enable_dp_attention=True, pp_size=2,
                           enable_dsa_cache_layer_split=False):
        rank = read_rank_config(get_parallel(), SimpleNamespace(pp_rank=1, system_dp_rank=1))
        parallel = get_parallel()
        assert rank == RankConfig(
            attn_tp_size=parallel.attn_tp_size, attn_tp_rank=parallel.attn_tp_rank,
            attn_dp_size=parallel.attn_dp_size, attn_dp_rank=parallel.attn_dp_rank,
            attn_cp_size=parallel.attn_cp_size, attn_cp_rank=parallel.attn_cp_rank,
            pp_size=2, pp_rank=1, system_dp_size=parallel.dp_size, system_dp_rank=1,
            layer_split=False, kv_sharding=False, cp_tp_group_sharing=False)
        assert rank.attn_tp_size * rank.attn_dp_size == 4  # DP attention splits the TP ranks


@pytest.mark.parametrize("kv_args", [SimpleNamespace(), SimpleNamespace(pp_rank=None, system_dp_rank=None)])
def test_an_unset_stage_or_dp_rank_is_zero(kv_args):
    with published_context():
        rank = read_rank_config(get_parallel(), kv_args)
    assert (rank.pp_rank, rank.system_dp_rank, rank.pp_size, rank.system_dp_size) == (0, 0, 1, 1)
    assert (rank.attn_tp_size, rank.attn_tp_rank, rank.attn_cp_size) == (1, 0, 1)

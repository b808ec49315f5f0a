"""dsa-bridge as sglang's PD transfer (``plugin/sglang/conn.py``, ``plugin/sglang/kvargs.py``),
against the real sglang 0.5.23 on the CPU.

- ``get_kv_class`` returns dsa-bridge's classes after sglang's own ``load_plugins()``, only for
  Mooncake and NIXL, only when ``SGLANG_PLUGINS`` names the plugin; a pool that is not DSA gets
  sglang's own manager (a real ``MooncakeKVManager``) from dsa-bridge's class;
- the KVArgs sglang's own code fills for its DSA pools (no layer ids) become dsa-bridge buffers
  with derived layer ids, uniform and compact, and what does not fit is refused by name;
- prefill and decode in two processes (``pd_rank.py``), sglang's own pools, ``MetadataBuffers``
  and ``_init_kv_manager``, driven in the order of sglang's queues: byte-exact on the KV and
  indexer of every layer and on the aux slot, both engines, DeepSeek-V3.2 and GLM-5.2 (uniform
  and compact); a compact prefill against a uniform decode, and another layer range, refused at
  the handshake with decode's pool still at its sentinel; a two-stage prefill through sglang's
  own ``poll_and_all_reduce_prefill_pp`` (``poll_pp_consensus``);
- a prefill decode cannot pair with (kv_layout, page size, dtype, KV sharding at another width)
  refused from the bootstrap server's parallel info, never raised: the reason, naming the flag
  to change, logged once and failing the prefill's receivers (attention-TP widths:
  test_sglang_tp_widths.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import torch

from tests.conftest import require_engine
from tests.ports import free_port

from .. import forkserver
from ..forkserver import RankProcess
from .conftest import SGLANG_MISSING, published_context

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.disaggregation.base import KVArgs  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, setup_state_kv_args  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangPool  # noqa: E402

from dsa_bridge.plugin.sglang.conn import (  # noqa: E402
    DSABridgeKVBootstrapServer,
    DSABridgeKVManager,
    DSABridgeKVReceiver,
)
from dsa_bridge.plugin.sglang.kvargs import bridge_buffers, dsa_problem  # noqa: E402
from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LAYOUT_KW = dict(page_size=64, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
DSV32 = dict(size=64 * 8, dtype=torch.float8_e4m3fn, layer_num=4, device="cpu", enable_memory_saver=False,
             kv_cache_dim=656, **LAYOUT_KW)
GLM_SKIP = [False, False, False, True, True, True, False, True]  # GLM-5.2's first 8 layers
GLM = {**DSV32, "layer_num": 8, "kv_cache_dim": 576}


def kv_args_of(pool, *, start_layer: int | None = None) -> KVArgs:
    """KVArgs as sglang's prefill ``_init_kv_manager`` fills them for a DSA pool (no layer ids)."""
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.kv_layer_ids, args.num_draft_entries, args.page_size = [], 0, pool.page_size
    args.prefill_start_layer = pool.start_layer if start_layer is None else start_layer
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [4096], [64 * 8], [64]
    setup_state_kv_args(args, pool)
    return args


# ---- get_kv_class through sglang's own load_plugins (own processes) -----------------------------

PROBE = """
import json, logging
import tests.sglang.conftest as shims
logging.basicConfig(level=logging.INFO)
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
from sglang.srt.managers import disagg_service
name = lambda c: None if c is None else ".".join(c.__module__.split(".")[-2:]) + "." + c.__qualname__
out = {b.value: {t.value: name(get_kv_class(b, t)) for t in KVClassType}
       for b in (TransferBackend.MOONCAKE, TransferBackend.NIXL, TransferBackend.FAKE)}
out["disagg_service_sees_hook"] = disagg_service.get_kv_class is get_kv_class
if FALLBACK:
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode, setup_state_kv_args
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    import torch
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine)
    init_mooncake_transfer_engine("127.0.0.1")  # as sglang's model runner does for PD
    with shims.published_context(disaggregation_mode="decode",
                                 disaggregation_transfer_backend="mooncake") as server_args:
        pool = MLATokenToKVPool(size=128, page_size=64, dtype=torch.bfloat16, kv_lora_rank=512,
                                qk_rope_head_dim=64, layer_num=2, device="cpu", enable_memory_saver=False)
        args = KVArgs()
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
        args.kv_layer_ids, args.page_size, args.engine_rank, args.pp_rank = [], 64, 0, 0
        args.kv_cache_dtype_str, args.kv_layout, args.system_dp_rank = "auto", None, 0
        args.ib_device, args.gpu_id = "", 0
        setup_state_kv_args(args, pool)
        cls = get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER)
        manager = cls(args, DisaggregationMode.DECODE, server_args, True)
        out["fallback"] = [name(cls), name(type(manager))]
print("RESULT " + json.dumps(out))
"""


def probe(plugins: str | None, fallback: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    env.update(SGLANG_HOST_IP="127.0.0.1", MC_LOG_LEVEL="ERROR")
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    out = forkserver.run(["-c", f"FALLBACK = {fallback}\n" + PROBE], env, str(ROOT), timeout_s=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**result_of(out.stdout), "log": out.stderr}


def test_get_kv_class_gives_dsa_bridge_classes_for_mooncake_and_nixl_and_falls_back_per_model():
    require_engine("mooncake")
    got = probe("dsa_bridge", fallback=True)
    for backend in ("mooncake", "nixl"):
        assert got[backend] == {
            "kvargs": "base.conn.KVArgs",
            "manager": "sglang.manager.DSABridgeKVManager",
            "sender": "sglang.sender.DSABridgeKVSender",
            "receiver": "sglang.receiver.DSABridgeKVReceiver",
            "bootstrap_server": "sglang.conn.DSABridgeKVBootstrapServer",
        }, backend
    assert got["fake"]["sender"] == "fake.conn.FakeKVSender"  # other backends: sglang's
    assert got["disagg_service_sees_hook"]  # the modules that imported it by name see the hook too
    # an MLA pool (no DSA state): dsa-bridge's class builds sglang's own Mooncake manager
    assert got["fallback"] == ["sglang.manager.DSABridgeKVManager", "mooncake.conn.MooncakeKVManager"]
    assert "sglang's MooncakeKVManager moves this pool" in got["log"]


def test_get_kv_class_is_sglangs_when_the_plugin_is_not_named():
    got = probe("some_other_plugin")
    assert got["mooncake"]["manager"] == "mooncake.conn.MooncakeKVManager"
    assert got["nixl"]["receiver"] == "nixl.conn.NixlKVReceiver"


# ---- KVArgs -> dsa-bridge buffers (sglang's own pools and setup_state_kv_args) ---------------------

@pytest.mark.usefixtures("sglang_context")
@pytest.mark.parametrize("cls", [SGLangPool, BridgeDSATokenToKVPool])
def test_kv_args_of_sglang_dsa_pools_get_derived_layer_ids_and_their_layout(cls):
    pool = cls(**DSV32)
    args = kv_args_of(pool)
    assert args.kv_layer_ids == [] and args.state_layer_ids == [[]]  # what sglang gives for DSA
    got = bridge_buffers(args, start_layer=args.prefill_start_layer)
    assert got.kv_layer_ids == [0, 1, 2, 3]
    assert got.layout == BridgeDSATokenToKVPool(**DSV32).layout
    descs = got.buffers.buffer_descriptors()
    assert [(d.layer_id, d.kind) for d in descs] == [(i, k) for i in range(4) for k in ("kv", "index")]
    assert [(d.ptr, d.nbytes) for d in descs if d.kind == "index"] == \
        [(t.data_ptr(), t.nbytes) for t in pool.index_k_with_scale_buffer]
    assert got.aux == [(4096, 512, 64)]


@pytest.mark.usefixtures("sglang_context")
def test_glm_compact_pool_and_a_pipeline_stage_keep_their_global_layer_ids():
    compact = kv_args_of(SGLangPool(**GLM, skip_topk_layers=GLM_SKIP))
    got = bridge_buffers(compact, start_layer=0)
    assert (got.layout.kv_dtype, got.layout.indexer_layout) == ("fp8_raw", "compact")
    assert got.layout.index_layer_ids == (0, 1, 2, 6)
    assert [d.layer_id for d in got.buffers.buffer_descriptors() if d.kind == "index"] == [0, 1, 2, 6]
    stage = kv_args_of(SGLangPool(**DSV32, start_layer=30))
    assert bridge_buffers(stage, start_layer=stage.prefill_start_layer).kv_layer_ids == [30, 31, 32, 33]


@pytest.mark.usefixtures("sglang_context")
def test_a_last_pipeline_stages_draft_entries_follow_its_last_layer():
    """With pipeline stages only the last stage runs the draft model and appends its pool's
    entries (sglang's ``EAGLEWorkerV2._hosts_draft``): they take the ids after its range."""
    args = kv_args_of(SGLangPool(**DSV32))
    args.num_draft_entries = 1
    stage = bridge_buffers(args, start_layer=58)  # target layers 58-60 of 61, then the draft's
    assert stage.kv_layer_ids == [58, 59, 60, 61] and stage.draft_layer_ids == [61]


@pytest.mark.usefixtures("sglang_context")
def test_kv_args_dsa_bridge_cannot_describe_are_refused_by_name():
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    mla = MLATokenToKVPool(size=128, page_size=64, dtype=torch.bfloat16, kv_lora_rank=512,
                           qk_rope_head_dim=64, layer_num=2, device="cpu", enable_memory_saver=False)
    assert "state types none are not exactly sglang's DSA indexer state" in dsa_problem(kv_args_of(mla))
    args = kv_args_of(SGLangPool(**DSV32))
    args.num_draft_entries = 4
    with pytest.raises(ValueError, match="num_draft_entries 4 does not fit 4 KV entries"):
        bridge_buffers(args, start_layer=0)
    args.num_draft_entries = 0
    args.kv_layer_ids = [0, 1, 2, 5]
    with pytest.raises(ValueError, match=r"kv_layer_ids \[0, 1, 2, 5\] differ"):
        bridge_buffers(args, start_layer=0)
    args.kv_layer_ids = []
    args.kv_item_lens = [64 * 600] * 4
    with pytest.raises(ValueError, match="a KV row of 600 bytes"):
        bridge_buffers(args, start_layer=0)


# ---- prefill and decode in two processes -----------------------------------------------------

# a rank's module by its role; any other role: pd_rank.py
RANK_MODULES = {"prealloc": "tests.sglang.prealloc_rank", "release": "tests.sglang.release_rank",
                "restart": "tests.sglang.restart_rank", "tp-prefill": "tests.sglang.tp_rank",
                "tp-decode": "tests.sglang.tp_rank", "early-prefill": "tests.sglang.tp_rank",
                "width-prefill": "tests.sglang.width_rank", "width-decode": "tests.sglang.width_rank",
                "saver-prefill": "tests.sglang.saver_rank", "saver-decode": "tests.sglang.saver_rank",
                "queue-prefill": "tests.sglang.queue_rank", "queue-decode": "tests.sglang.queue_rank"}
RANK_ENV = {"SGLANG_PLUGINS": "dsa_bridge", "SGLANG_HOST_IP": "127.0.0.1", "MC_LOG_LEVEL": "ERROR",
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}


def start_rank(role: str, cfgs: list[dict] | dict, module: str | None = None, env: dict | None = None,
               stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> RankProcess:
    """One rank's process (``module``, else its module by ``role``), as sglang's scheduler process
    would run, forked from the tier's fork server (``forkserver.py``: sglang imported once); its
    environment ``RANK_ENV``, then ``env``, over this one's."""
    module = module or RANK_MODULES.get(role, "tests.sglang.pd_rank")
    return RankProcess(["-m", module, role, json.dumps(cfgs)], {**os.environ, **RANK_ENV, **(env or {})},
                       str(ROOT), stdout, stderr)


def run_ranks(ranks: list[tuple[str, list[dict] | dict]], module: str | None = None,
              env: dict | None = None, timeout_s: float = 270) -> list:
    """Every rank at once, each its own process (``start_rank``, as sglang's schedulers) stepping
    through its scenarios; their RESULTs. Output goes to files (a pipe read only after another
    process ended would fill and block a rank that logs while it waits); every process always
    stopped. ``timeout_s`` bounds them all, below the suite's per-test timeout, so that ranks still
    running by then fail the test with their own output's tail."""
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in ranks]
    procs: list[RankProcess] = []
    deadline = time.monotonic() + timeout_s
    with stopped_at_end(procs, [f for pair in files for f in pair]):
        for (role, cfgs), (out, err) in zip(ranks, files, strict=True):
            procs.append(start_rank(role, cfgs, module, env, stdout=out, stderr=err))
        results = []
        for (role, _), proc, (out, err) in zip(ranks, procs, files, strict=True):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"ranks still running after {timeout_s:.0f} s:\n"
                                     + still_running(ranks, procs, files)) from None
            err.seek(0)
            assert proc.returncode == 0, f"{role}:\n{err.read()[-4000:]}"
            out.seek(0)
            results.append(result_of(out.read()))
        return results


def still_running(ranks: list, procs: list[RankProcess], files: list) -> str:
    """Each rank's state and its output's last lines, for a run that timed out: a rank still
    running first dumps every thread's stack to its stderr (``SIGUSR1``, which the rank scripts
    hand to ``faulthandler``)."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0 if running else 0.0)  # the dump is written from the signal handler
    parts = []
    for (role, _), proc, (out, err) in zip(ranks, procs, files, strict=True):
        out.seek(0)
        err.seek(0)
        state = "running" if proc.poll() is None else f"exited {proc.returncode}"
        parts.append(f"--- {role} (pid {proc.pid}, {state}): stdout {out.read()[-800:]!r}\n"
                     f"stderr {err.read()[-6000:]}")
    return "\n".join(parts)


def result_of(output: str):
    """The ``RESULT`` a rank script printed in ``output``."""
    line = next(ln for ln in output.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@contextlib.contextmanager
def stopped_at_end(procs: list, files: list):
    """However the block ends: every process of ``procs`` still running killed (by its own
    handle) and waited for, and every file of ``files`` closed."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in files:
            f.close()


def scenarios_per_engine(run: Callable[[str], list[list[dict]]], scenarios) -> Callable[[str], dict]:
    """A module fixture's ``engine -> {scenario: (each rank's result)}``: ``run(engine)`` (each
    rank's results, one per scenario, in the order of ``scenarios``) on the first call for that
    engine (a missing engine skips the test), kept for the module's other tests."""
    done = {}

    def get(engine: str) -> dict:
        if engine not in done:
            require_engine(engine)
            ranks = run(engine)
            done[engine] = {name: tuple(rank[i] for rank in ranks) for i, name in enumerate(scenarios)}
        return done[engine]

    return get


def run_pd(prefill_cfgs: list[dict], decode_cfgs: list[dict]) -> tuple[list[dict], list[dict]]:
    prefill, decode = run_ranks([("prefill", prefill_cfgs), ("decode", decode_cfgs)])
    return prefill, decode


def config(engine: str, model: dict, **extra) -> dict:
    return {"engine": engine, "port": free_port(), "room": 2**62 + 12345, "pages": 8, "seed": 7,
            "src_pages": [3, 1, 4, 5, 6], "dst_pages": [2, 7, 5, 6, 8], "src_aux": 3, "dst_aux": 5,
            "bootstrap_wait_s": 180, **model, **extra}


MODELS = {
    "deepseek-v3.2": {"layers": 4, "model_layers": 4, "kv_cache_dim": 656},
    # with a draft model (MTP): sglang appends its pool's KV and indexer entries to the target's
    "deepseek-v3.2-mtp": {"layers": 4, "model_layers": 4, "kv_cache_dim": 656, "draft_layers": 1},
    "glm-5.2-uniform": {"layers": 8, "model_layers": 8, "kv_cache_dim": 576},
    "glm-5.2-compact": {"layers": 8, "model_layers": 8, "kv_cache_dim": 576, "skip": GLM_SKIP},
}


@pytest.fixture(scope="module")
def transfers():
    """engine -> {model: (config, prefill result, decode result)}: one process pair per engine
    runs the models in turn (sglang's import costs most of a rank's start)."""
    done = {}

    def run(engine: str) -> dict:
        if engine not in done:
            require_engine(engine)
            cfgs = [config(engine, MODELS[m]) for m in sorted(MODELS)]
            prefill, decode = run_pd(cfgs, cfgs)
            done[engine] = {m: (c, p, d) for m, c, p, d in zip(sorted(MODELS), cfgs, prefill, decode,
                                                                strict=True)}
        return done[engine]

    return run


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_prefill_to_decode_in_two_processes_byte_exact(transfers, engine, model):
    cfg, prefill, decode = transfers(engine)[model]
    assert prefill["manager"] == decode["manager"] == "DSABridgeKVManager"
    assert (prefill["server"], prefill["sender"], decode["receiver"]) == \
        ("DSABridgeKVBootstrapServer", "DSABridgeKVSender", "DSABridgeKVReceiver")
    assert prefill["kv_layer_ids"] == [] and prefill["state_layer_ids"] == [[]]  # sglang named none
    assert decode["poll"] == prefill["poll"] == 4  # Success on both sides
    target = MODELS[model]["layers"]
    layers = target + MODELS[model].get("draft_layers", 0)  # the draft's: the next ids
    skip = (MODELS[model].get("skip") or [False] * target) + [False] * (layers - target)
    index_layers = [i for i in range(layers) if not skip[i]]
    held = [f"kv:{i}" for i in range(layers)] + [f"index:{i}" for i in index_layers]
    assert decode["buffers"] == sorted(held)
    assert decode["mismatched"] == [] and decode["others_sentinel"]
    assert decode["aux_exact"] and decode["aux_others_sentinel"]
    pages = len(cfg["src_pages"])
    expected = pages * 64 * (layers * cfg["kv_cache_dim"] + len(index_layers) * 132) + decode["aux_bytes"]
    assert decode["nbytes"] == prefill["bytes"] == expected


REFUSALS = {
    "compact-prefill-uniform-decode": ({"skip": GLM_SKIP}, "layer 3: decode holds and reads its indexer"),
    "other-layer-range": ({"start_layer": 2}, "layer sets: prefill holds layer 8, which decode does not"),
}


@pytest.fixture(scope="module")
def refusals():
    require_engine("nixl")
    names = sorted(REFUSALS)
    decode_cfgs = [config("nixl", MODELS["glm-5.2-uniform"]) for _ in names]
    prefill_cfgs = [{**cfg, **REFUSALS[name][0]} for cfg, name in zip(decode_cfgs, names, strict=True)]
    prefill, decode = run_pd(prefill_cfgs, decode_cfgs)
    return dict(zip(names, zip(prefill, decode, strict=True), strict=True))


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_mismatched_pd_pair_is_refused_before_any_write(refusals, name):
    prefill, decode = refusals[name]
    reason = REFUSALS[name][1]
    assert decode["poll"] == 0 and reason in decode["reason"]
    assert decode["untouched"]  # decode's pool still at its sentinel: nothing was written
    assert prefill["poll"] == 1  # prefill never got the request: still Bootstrapping
    assert len(prefill["refused"]) == 1 and reason in prefill["refused"][0]


@pytest.mark.parametrize("draft", [0, 1])
def test_pipelined_prefill_into_one_decode_stage_byte_exact(draft):
    """sglang's PP prefill (two stages, each its own process and rank, layers 0-1 and 2-3) into a
    one-stage decode: the bootstrap queue as sglang runs it with stages (its own
    ``poll_and_all_reduce_prefill_pp`` over gloo groups, stage 0 polling ``poll_pp_consensus``),
    stage 1 making its sender a second after decode's pages reached it; then each stage writes its
    layers, the last one the aux slot. With a draft model (``draft``), only the last stage holds
    its pool, as sglang runs the draft there, and writes its KV and indexer as layer 4."""
    require_engine("nixl")
    cfg = config("nixl", MODELS["deepseek-v3.2"], draft_layers=draft)
    dist_port = free_port()
    stages = [{**cfg, "layers": 2, "start_layer": 2 * r, "pp_size": 2, "pp_rank": r,
               "dist_port": dist_port, "late_sender_s": 1.0, "draft_layers": draft * r}
              for r in range(2)]
    (first,), (second,), (decode,) = run_ranks([("prefill", [stages[0]]), ("prefill", [stages[1]]),
                                               ("decode", [cfg])])
    # the stages' consensus: stage 0's own status was WaitingForInput while stage 1 had no sender,
    # and the verdict (WaitingForInput on both stages) came once every stage was ready
    assert first["stages"]["held"] > 10
    assert first["stages"]["verdict"] == second["stages"]["verdict"] == 2
    assert first["stages"]["own_at_verdict"] >= 2 and second["stages"]["own_at_verdict"] >= 2
    # derived from prefill_start_layer; the draft's entries after the last stage's
    assert (first["layers"], second["layers"]) == ([0, 1], [2, 3, 4][:2 + draft])
    assert decode["poll"] == first["poll"] == second["poll"] == 4
    assert decode["stages"] == 2
    assert ("kv:4" in decode["buffers"]) == bool(draft)
    assert decode["mismatched"] == [] and decode["others_sentinel"]
    assert decode["aux_exact"] and decode["aux_others_sentinel"]
    page_bytes = 64 * (656 + 132)
    pages = len(cfg["src_pages"])
    assert first["bytes"] == pages * page_bytes * 2  # no aux: the stage without the last layer
    assert second["bytes"] == pages * page_bytes * (2 + draft) + decode["aux_bytes"]
    assert decode["nbytes"] == first["bytes"] + second["bytes"]


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_pipelined_prefill_into_as_many_decode_stages_byte_exact(engine):
    """sglang's PP on both sides (``--pp-size 2`` on prefill and decode, four processes): decode
    stage ``k`` reads prefill stage ``k`` only, its layers named from its pool's ``start_layer``
    (its KVArgs do not say them); each decode stage byte-exact on its layers and its own aux
    slot, written by its prefill stage, the rest of its pool at the sentinel."""
    require_engine(engine)
    cfg = config(engine, MODELS["deepseek-v3.2"])
    prefill_port, decode_port = free_port(), free_port()
    stages = [{**cfg, "layers": 2, "start_layer": 2 * r, "pp_size": 2, "pp_rank": r, "late_sender_s": 0.0}
              for r in range(2)]
    results = run_ranks([("prefill", [{**stages[0], "dist_port": prefill_port}]),
                         ("prefill", [{**stages[1], "dist_port": prefill_port}]),
                         ("decode", [{**stages[0], "dist_port": decode_port}]),
                         ("decode", [{**stages[1], "dist_port": decode_port}])])
    (first,), (second,), *decodes = results
    page_bytes = 64 * (656 + 132)
    for rank, (prefill, (decode,)) in enumerate(zip((first, second), decodes, strict=True)):
        assert decode["layers"] == prefill["layers"] == [2 * rank, 2 * rank + 1]
        assert decode["poll"] == prefill["poll"] == 4, decode.get("reason")
        assert decode["stages"] == 1  # its own prefill stage only
        assert decode["mismatched"] == [] and decode["others_sentinel"]
        assert decode["buffers"] == [f"index:{2 * rank}", f"index:{2 * rank + 1}",
                                     f"kv:{2 * rank}", f"kv:{2 * rank + 1}"]
        assert decode["aux_exact"] and decode["aux_others_sentinel"]
        expected = len(cfg["src_pages"]) * page_bytes * 2 + decode["aux_bytes"]  # its 2 layers, its aux
        assert prefill["bytes"] == decode["nbytes"] == expected


# ---- decode: what dsa-bridge cannot pair with, refused from the bootstrap's parallel info ----------

def registration(**changes) -> dict:
    """A prefill rank's ``PUT /route`` payload, as dsa-bridge's manager sends it."""
    return {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
            "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": "127.0.0.1", "rank_port": 1, "page_size": 64, "kv_cache_dtype": "fp8_e4m3",
            "kv_layout": "dsa-bridge", "load_balance_method": "follow_bootstrap_room", **changes}


def put_route(port: int, payload: dict) -> None:
    """Register one prefill rank, as a manager does; bounded wait for the server's thread."""
    deadline = time.monotonic() + 10
    while True:
        try:
            response = requests.put(f"http://127.0.0.1:{port}/route", json=payload, timeout=5)
            assert response.status_code == 200, response.text
            return
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize(("changes", "message"), [
    ({"kv_layout": None}, "registered kv_layout None, not dsa-bridge's: .*set SGLANG_PLUGINS=dsa_bridge "
                          "on the prefill too"),
    ({"page_size": 32}, r"page size: prefill 32, decode 64 \(both servers need the same --page-size\)"),
    ({"kv_cache_dtype": "bf16"}, "KV cache dtype: prefill bf16, decode fp8_e4m3 .*--kv-cache-dtype"),
    ({"enable_kv_cache_sharding": True, "attn_tp_size": 2},
     r"--enable-kv-cache-sharding on the prefill needs equal attention-TP widths .*prefill 2, "
     r"decode 1 .*or remove it\)"),
])
def test_decode_refuses_a_prefill_it_cannot_pair_with_naming_the_flag(changes, message, caplog):
    """Never raised (sglang's prealloc queue does not catch it): False, the reason logged once,
    and the prefill's receivers Failed with it — before any init, which sglang never calls then."""
    port = free_port()
    server = DSABridgeKVBootstrapServer("127.0.0.1", port)
    try:
        for tp in range(changes.get("attn_tp_size", 1)):
            for cp in range(changes.get("attn_cp_size", 1)):
                for dp in range(changes.get("attn_dp_size", 1)):
                    put_route(port, registration(**changes, attn_tp_rank=tp, attn_cp_rank=cp,
                                                 attn_dp_rank=dp))
        with published_context(disaggregation_mode="decode", disaggregation_transfer_backend="nixl") as sa:
            args = kv_args_of(SGLangPool(**DSV32))
            args.kv_cache_dtype_str = "fp8_e4m3"
            manager = DSABridgeKVManager(args, DisaggregationMode.DECODE, sa, True)
            addr = f"127.0.0.1:{port}"
            receiver = DSABridgeKVReceiver(manager, addr, 77)
            assert receiver.poll() == 1  # Bootstrapping: nothing known yet
            with caplog.at_level(logging.WARNING, logger="dsa_bridge.plugin.sglang"):
                assert [manager.try_ensure_parallel_info(addr) for _ in range(3)] == [False] * 3
                others = [DSABridgeKVReceiver(manager, addr, room) for room in (78, 79)]
                assert [r.poll() for r in [receiver, *others]] == [0, 0, 0]  # Failed
            for r in [receiver, *others]:
                with pytest.raises(RuntimeError, match=message):
                    r.failure_exception()
            logged = [r.getMessage() for r in caplog.records if "cannot pair" in r.getMessage()]
            assert len(logged) == 1 and re.search(message, logged[0])  # once for the prefill
            assert manager.prefill_info_table == {} and manager.decode_nodes.nodes == {}
    finally:
        server.close()


def test_a_stages_shutdown_waits_for_sglangs_consensus_store_a_bounded_time(monkeypatch, caplog):
    """sglang's ``PPConsensusStore.close()`` was seen blocking for good in its zmq context's term
    on a later stage whose stage 0 had exited (a CI run's stack dump): the manager's shutdown
    waits for it at most ``STORE_CLOSE_S``, saying so."""
    import threading

    from dsa_bridge.plugin.sglang import stage_consensus

    release = threading.Event()

    class StuckStore:
        def close(self):
            release.wait(30)

    stages = stage_consensus.StageConsensus(2, 1)
    stages.store = StuckStore()
    monkeypatch.setattr(stage_consensus, "STORE_CLOSE_S", 0.2)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dsa_bridge.plugin.sglang"):
        stages.close()
    assert time.monotonic() - started < 5
    assert "PPConsensusStore did not close within" in caplog.text
    release.set()

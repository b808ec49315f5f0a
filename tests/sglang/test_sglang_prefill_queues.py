"""dsa-bridge's KVSender driven by sglang 0.5.23's own prefill queues (``queue_rank.py``), against
the real sglang on the CPU, prefill and decode each its own process, both engines:

- a real ``PrefillBootstrapQueue``: ``add`` makes dsa-bridge's sender, ``pop_bootstrapped`` polls
  it over gloo until decode's pages arrive and ``init``\\s it with the request's page count and
  metadata slot; sglang's own ``send_kv_chunk`` sends a first chunk (its whole pages) and the
  last one (the rest, sglang's ``set_buf`` aux slot and DSA state indices), and sglang's own
  ``process_disagg_prefill_inflight_queue`` polls it until the request leaves Success, releasing
  its pages, row and metadata slot through sglang's allocators: byte-exact on KV, indexer and
  aux at decode (the aux slot as sglang's decode reads it: the first token, the room);
- the client aborts the request at decode while prefill's request waits in sglang's bootstrap
  queue: ``pop_bootstrapped`` sees Failed and sglang's own ``handle_bootstrap_failure`` aborts
  it with dsa-bridge's reason, streams it, and holds nothing;
- the client aborts the request at prefill while it waits in sglang's bootstrap queue (the
  scheduler's ``disagg_kv_sender.abort()``): sglang's ``handle_bootstrap_failure`` again, and
  decode's request, whose pages come later, fails at once with the reason;
- a decode radix-cache hit covering the whole page-aligned prompt (``decode_prefix_len`` its
  length, no page asked for): sglang's ``finalize_bootstrap`` calls ``init(0)``, its
  ``send_kv_chunk`` asks ``should_send_kv_chunk(0, last_chunk=True)`` and sends the empty last
  chunk; only the aux slot moves (the first token delivered), no page of decode's is written;
- host page indices (``supports_host_tensor_indices``, as over a GPU pool): sglang's
  ``send_kv_chunk`` hands each chunk's indices over as a host tensor still being copied, with
  the event after the copy, and never runs its blocking ``kv_to_page_indices``; dsa-bridge's
  sender reads them only once the event completed: byte-exact;
- optimistic prefill (``--optimistic-prefill-attempts``): the request prefilled before decode's
  pages arrive, parked in sglang's inflight queue, then sent whole: byte-exact.

Stand-ins that remain (no GPU, no model): the queue and scheduler are built without their
constructors (``object.__new__``, the attributes their ``__init__`` sets: the constructors need
a model runner and a GPU); the forward (``queue_rank.forward``: the request's row and pages from
sglang's own ``alloc_req_slots`` and paged allocator, as ``alloc_for_extend`` gives them for a
``ScheduleBatch``, then the pool written); of ``process_batch_result_disagg_prefill`` only its
transfer steps (the first token, ``checkpoint_disagg_prefill``, the inflight queue, the last
``send_kv_chunk``); the output streamer records what sglang streams; the radix cache is sglang's
own, disabled.
"""

from __future__ import annotations

import pytest

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, free_port, run_ranks, scenarios_per_engine

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
ENGINES = ["mooncake", "nixl"]
SRC_PAGES = [3, 4, 5, 6, 7]  # sglang's paged allocator, after another request's pages 1-2
SCENARIOS = {  # decode's abort first: its prealloc queue sets up the process's gloo world
    "decode-abort": {"abort_after_s": 1.0, "linger_s": 3.0},
    "prefill-abort": {"prefill_abort_after_s": 0.5, "metadata_after_s": 2.0, "linger_s": 5.0},
    "transfer": {},
    "full-hit": {"aligned": True, "prefix_tokens": len(SRC_PAGES) * 64},
    "host-indices": {"host_indices": True},
    "optimistic": {"optimistic_attempts": 1, "metadata_after_s": 1.0},
    "prefill-complete": {"policy": "prefill_complete", "optimistic_attempts": 1, "forward_after_s": 1.0},
}


@pytest.fixture(scope="module")
def queues(tmp_path_factory):
    """engine -> {scenario: (prefill result, decode result)}, one process pair per engine."""

    def run(engine: str):
        files = tmp_path_factory.mktemp(engine)
        cfgs = [config(engine, MODEL, scenario=name, src_pages=SRC_PAGES, port=free_port(),
                       dist_port=free_port(), bootstrap_wait_s=120, **extra,
                       **({"added_file": str(files / name)} if "policy" in extra else {}))
                for name, extra in SCENARIOS.items()]
        decode_cfgs = [{**cfg, "dist_port": free_port()} for cfg in cfgs]
        prefill, decode = run_ranks([("queue-prefill", cfgs), ("queue-decode", decode_cfgs)])
        return prefill, decode

    return scenarios_per_engine(run, SCENARIOS)


@pytest.mark.parametrize("engine", ENGINES)
def test_sglang_prefill_queues_move_a_request_byte_exact(queues, engine):
    prefill, decode = queues(engine)["transfer"]
    assert (prefill["manager"], prefill["sender"]) == ("DSABridgeKVManager", "DSABridgeKVSender")
    # the bootstrap queue: held while decode had not sent its pages, then popped and init'ed
    assert prefill["in_bootstrap_queue"] == 1 and prefill["bootstrapping_steps"] > 0, prefill
    assert prefill["left_bootstrap_queue"] and prefill["popped"] == 1
    assert prefill["metadata_slot"] == 3 and prefill["start_send_idx"] == 0
    assert prefill["pages"] == SRC_PAGES
    assert prefill["start_send_idx_after_chunk"] == 128  # the first chunk's whole pages
    # the inflight queue: left with Success, everything the request held given back
    assert prefill["done"] == prefill["streamed"] == [f"queued-{2**62 + 12345}"]
    assert prefill["inflight"] == 0 and prefill["poll"] == 4 and prefill["finished"] == "FINISH_LENGTH"
    assert prefill["pages_released"] and prefill["slot_released"] and prefill["row_released"]
    assert prefill["pending_chunks"] == []
    # decode: byte-exact
    assert decode["poll"] == 4 and "reason" not in decode
    assert decode["mismatched"] == [] and decode["others_sentinel"]
    assert decode["aux_exact"] and decode["aux_others_sentinel"]
    assert decode["first_token"] == 4242 and decode["room"] == 2**62 + 12345
    page_bytes = 64 * (656 + 132)
    assert decode["nbytes"] == prefill["bytes"] == len(SRC_PAGES) * page_bytes * 4 + decode["aux_bytes"]
    # sglang's own KV-transfer series: observed from get_transfer_metric, not left empty
    assert prefill["observed_mb"] == prefill["bytes"] / 2**20
    assert prefill["observed_latency_ms"] > 0 and prefill["observed_gb_s"] > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_whole_prompt_decode_holds_moves_only_the_first_token(queues, engine):
    prefill, decode = queues(engine)["full-hit"]
    assert prefill["start_send_idx"] == len(SRC_PAGES) * 64  # sglang's finalize_bootstrap
    assert prefill["init_pages"] == 0 and prefill["chunks_sent"] == 1  # the empty last chunk
    assert prefill["done"] == prefill["streamed"] and prefill["poll"] == 4
    assert prefill["pages_released"] and prefill["slot_released"] and prefill["row_released"]
    assert decode["poll"] == 4, decode.get("reason")
    assert decode["receiver_pages"] == 0
    assert decode["prefix_sentinel"] and decode["others_sentinel"]  # no page written
    assert decode["aux_exact"] and decode["aux_others_sentinel"]
    assert decode["first_token"] == 4242 and decode["room"] == 2**62 + 12345
    assert decode["nbytes"] == prefill["bytes"] == decode["aux_bytes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_page_indices_arrive_as_host_arrays_read_once_their_copy_completed(queues, engine):
    prefill, decode = queues(engine)["host-indices"]
    assert prefill["blocking_copies"] == 0  # sglang's blocking copy never ran
    assert [send[:3] for send in prefill["sends"]] == [["Tensor", "cpu", True]] * 2
    assert prefill["sends"][0][3] == 0  # nothing handed on while the copy was in flight
    assert prefill["done"] == prefill["streamed"] and prefill["poll"] == 4
    assert prefill["pages_released"] and prefill["slot_released"] and prefill["row_released"]
    assert decode["poll"] == 4, decode.get("reason")
    assert decode["mismatched"] == [] and decode["others_sentinel"]
    assert decode["aux_exact"] and decode["first_token"] == 4242
    assert decode["nbytes"] == prefill["bytes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_decode_abort_fails_the_request_in_sglangs_bootstrap_queue(queues, engine):
    prefill, decode = queues(engine)["decode-abort"]
    assert decode["notified"] and decode["removed"] == ["aborted"]
    assert prefill["bootstrapping_steps"] > 0 and prefill["left_bootstrap_queue"], prefill
    assert prefill["popped"] == 0 and prefill["poll_after_bootstrap"] == 0
    assert "Prefill bootstrap failed" in prefill["finished"]
    assert "aborted by sglang" in prefill["finished"]
    assert prefill["status"] == 500 and prefill["streamed"] == [f"queued-{2**62 + 12345}"]
    assert prefill["slots_free"] and prefill["pages_free"]


@pytest.mark.parametrize("engine", ENGINES)
def test_an_optimistic_prefill_parks_until_decode_pages_arrive_then_sends(queues, engine):
    """``--optimistic-prefill-attempts 1``: ``pop_bootstrapped`` lets the request prefill while
    its sender still bootstraps; sglang's ``check_bootstrap`` holds its first chunk, its inflight
    queue parks it (``handle_pending_bootstrap``) until decode's pages arrive, then
    ``finalize_bootstrap`` inits the sender and the whole request goes in one last chunk."""
    prefill, decode = queues(engine)["optimistic"]
    assert prefill["bootstrapping_steps"] == 0 and prefill["popped"] == 1
    assert prefill["poll_after_bootstrap"] == 1  # popped while Bootstrapping
    assert prefill["start_send_idx_after_chunk"] == 0  # the first chunk held back
    assert prefill["parked_steps"] > 0, prefill
    assert prefill["done"] == prefill["streamed"] and prefill["poll"] == 4
    assert prefill["pages_released"] and prefill["slot_released"] and prefill["row_released"]
    assert decode["poll"] == 4 and decode["mismatched"] == [] and decode["others_sentinel"]
    assert decode["aux_exact"] and decode["aux_others_sentinel"]
    assert decode["nbytes"] == prefill["bytes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prefill_abort_in_the_bootstrap_queue_fails_decode_with_the_reason(queues, engine):
    prefill, decode = queues(engine)["prefill-abort"]
    assert "Prefill bootstrap failed" in prefill["finished"] and "aborted by sglang" in prefill["finished"]
    assert prefill["slots_free"] and prefill["pages_free"]
    assert decode["poll"] == 0 and decode["reason"].endswith("aborted by sglang")
    assert decode["ended_after_s"] < 10, decode  # told, not waiting out its timeout


@pytest.mark.parametrize("engine", ENGINES)
def test_prefill_complete_decode_allocates_only_once_the_prefill_computed_the_request(queues, engine):
    """``--disaggregation-decode-allocation-policy prefill_complete`` on both servers (sglang
    itself allows it on Mooncake only): decode's request waits in sglang's own prealloc queue,
    Bootstrapping, unallocated, while the prefill computes it (popped at once, optimistic); the
    prefill's ``mark_prefill_complete`` lets decode allocate and send its pages, and the parked
    request then moves byte-exact."""
    prefill, decode = queues(engine)["prefill-complete"]
    assert prefill["bootstrapping_steps"] == 0 and prefill["popped"] == 1  # computed at once
    assert prefill["poll_after_bootstrap"] == 1  # still Bootstrapping: no pages from decode
    assert decode["polls_before_ready"] in ([1], [1, 2]) and decode["waiting_steps"] > 10
    # ready for its pages only once the mark began
    assert decode["ready_at"] >= prefill["marked_at"], (prefill, decode)
    assert decode["ready_after_s"] >= 1.0, decode  # the prefill computed it for a second meanwhile
    assert prefill["parked_steps"] > 0, prefill  # then parked until decode's pages came
    assert prefill["done"] == prefill["streamed"] and prefill["poll"] == 4
    assert prefill["pages_released"] and prefill["slot_released"] and prefill["row_released"]
    assert decode["poll"] == 4, decode.get("reason")
    assert decode["mismatched"] == [] and decode["others_sentinel"]
    assert decode["aux_exact"] and decode["aux_others_sentinel"]
    assert decode["nbytes"] == prefill["bytes"]

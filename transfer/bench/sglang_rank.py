"""One sglang PD rank of ``dsa-bridge bench``'s ``sglang`` section, in its own process:
``python -m dsa_bridge.transfer.bench.sglang_rank --control ENDPOINT --role ROLE``.

Run only where sglang is installed. Which connector the rank uses is sglang's own choice: its
``load_plugins()`` and ``get_kv_class`` give sglang's ``MooncakeKVManager`` classes, or
dsa-bridge's when the bench sets ``SGLANG_PLUGINS=dsa_bridge`` for the process. As a scheduler
process on the CPU would (docs/sglang.md): a published ``ServerArgs``, sglang's own DSA
token-to-KV pool and ``MetadataBuffers``, sglang's shared Mooncake engine for its own manager,
and the manager made by sglang's own ``_init_kv_manager`` of ``PrefillBootstrapQueue`` /
``DecodePreallocQueue`` over a stand-in for the scheduler attributes it reads. The bench process
drives the rank over a ZMQ PAIR socket; each command (a msgpack map) gets one answer:

- ``setup``: the pool (``layers`` of DeepSeek-V3.2, ``pool_pages`` pages), the manager; prefill
  also runs the bootstrap server and fills its pool and aux buffers with bytes that are a
  function of (seed, buffer) only, which decode makes too, to compare with.
- ``prepare`` (decode): for each (room, slot, pages) — a request of that many pages, the
  slot-th of its wave, the same pages on both sides — its pages and aux row set to a sentinel,
  a receiver, the prefill's parallel info, ``init``, polled to WaitingForInput,
  ``send_metadata(pages, aux, [pages])`` (the prealloc queue). ``prepare`` (prefill): a sender
  per room, polled until decode's pages reached it (the bootstrap queue).
- ``go`` (prefill): the timed window starts: ``init`` and one ``send(pages, [pages])`` per
  request, as a prefill that finished its forward does, then polled to Success (the inflight
  queue) and cleared. ``wait`` (decode): the receivers polled to Success (the transfer queue),
  each one's time of Success, then cleared. Both poll with 1 ms sleeps between passes, or,
  ``busy`` (``Mode.busy``), as sglang's scheduler loop does. Both answer their window's
  monotonic clock times and the process's CPU seconds in it (every thread: the engine's too),
  also per thread (``thread_cpu``).
- ``verify`` (decode): each request's pages and aux row against the bytes prefill wrote: the
  buffers that differ, and the bytes compared.
- ``quit``.
"""

from __future__ import annotations

import argparse
import enum
import importlib.machinery
import importlib.util
import os
import sys
import time
import types
import zlib
from types import SimpleNamespace

import numpy as np
import torch

from .channel import serve_commands
from .sglang_pd import PAGE
from .thread_cpu import cpu_by_thread, snapshot

SENTINEL = 0xA5
POLL_S = 0.001  # how often a waiting queue polls its requests
STEP_TIMEOUT_S = 120.0


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def cpu_shims() -> None:
    """What sglang's CPU path needs that this machine lacks: sglang imports ``torchvision`` only
    for multimodal config code (``InterpolationMode``) — where it is missing, a stub module with
    that enum, installed once transformers has cached that torchvision is unavailable; and its
    DSA pool calls ``torch.cuda.synchronize``, a no-op without a CUDA device."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached False before the stub exists
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    modules = {name: types.ModuleType(name) for name in names}
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    modules["torchvision"].transforms = modules["torchvision.transforms"]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]
    for name in names[1:]:
        modules[name].InterpolationMode = InterpolationMode
    sys.modules.update(modules)


def wait_until(done, what: str, timeout_s: float = STEP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done in {timeout_s:.0f} s")
        time.sleep(POLL_S)


def expected(seed: int, key: str, shape: torch.Size) -> torch.Tensor:
    """The bytes prefill writes to one buffer (its rows of every request): a function of
    (seed, buffer) only, so decode makes the same to compare with."""
    nbytes = shape[0] * shape[1]
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    words = torch.randint(-2**62, 2**62, (-(-nbytes // 8),), dtype=torch.int64, generator=generator)
    return words.view(torch.uint8)[:nbytes].reshape(shape)


def reason_of(handle) -> str:
    try:
        handle.failure_exception()
    except Exception as exc:  # what sglang's queue would log and abort the request with
        return str(exc)
    return "no reason given"


class Rank:
    """One rank's pool, manager and requests (see the module docstring)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.requests: list[tuple[object, np.ndarray, int]] = []  # (sender/receiver, pages, slot)

    # ---- setup -------------------------------------------------------------------------------

    def setup(self, layers: int, pool_pages: int, slots: int, port: int, seed: int) -> dict:
        from sglang.srt.plugins import load_plugins

        load_plugins()  # first: the names imported below are then the plugin's hooks (if named)
        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
        from sglang.srt.disaggregation.utils import (
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
            is_mla_backend,
        )
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
        from sglang.srt.server_args import ServerArgs

        self.server_args = ServerArgs(
            model_path="dummy", device="cpu", disaggregation_mode=self.role,
            disaggregation_transfer_backend="mooncake", disaggregation_bootstrap_port=port,
            host="127.0.0.1")
        reset_context()
        publish(self.server_args, role="bench", ranks=SpawnRanks(world_rank=0, dp_rank=None))
        self.backend = TransferBackend.MOONCAKE
        self.kv_class = lambda kind: get_kv_class(self.backend, kind)
        self.kinds = KVClassType
        manager_class = self.kv_class(KVClassType.MANAGER)
        own = not manager_class.__module__.startswith("dsa_bridge")
        if own:  # sglang's model runner starts the shared engine its own manager takes
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                init_mooncake_transfer_engine,
            )

            init_mooncake_transfer_engine("127.0.0.1")
            get_parallel().override_permanently(pp_group=None)  # one stage
        self.server = None
        if self.role == "prefill":  # one per prefill server (sglang's main process)
            self.server = self.kv_class(KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
        self.addr = f"127.0.0.1:{port}"
        self.seed = seed
        self.pool = DSATokenToKVPool(
            size=PAGE * pool_pages, page_size=PAGE, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
            qk_rope_head_dim=64, layer_num=layers, device="cpu", index_head_dim=128,
            enable_memory_saver=False, kv_cache_dim=656, start_layer=0)
        self.metadata = MetadataBuffers(size=slots, hidden_size=64,
                                        hidden_states_dtype=torch.bfloat16,
                                        max_sampling_mask_tokens=16)
        scheduler = SimpleNamespace(
            rust_server=None, server_args=self.server_args, req_to_token_pool=None,
            enable_hisparse=False, model_config=SimpleNamespace(num_hidden_layers=layers,
                                                                hf_text_config=None),
            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="fp8_e4m3")))
        stand_in = SimpleNamespace(
            transfer_backend=self.backend, tp_rank=0, pp_rank=0, scheduler=scheduler,
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
            is_mla_backend=is_mla_backend(self.pool), metadata_buffers=self.metadata,
            enable_staging=False)
        queue = PrefillBootstrapQueue if self.role == "prefill" else DecodePreallocQueue
        self.manager = queue._init_kv_manager(stand_in)
        # prefill's bytes; decode keeps them to compare with
        self.expected = {key: expected(seed, key, rows.shape) for key, rows in self.views().items()}
        if self.role == "prefill":
            for key, rows in self.views().items():
                rows.copy_(self.expected.pop(key))
        return {"manager": type(self.manager).__qualname__, "pid": os.getpid()}

    def views(self) -> dict[str, torch.Tensor]:
        """Every buffer a request fills, as uint8 rows: ``kv:L`` and ``index:L`` one row a
        page, ``aux:I`` one row a request."""
        out = {}
        for layer, buf in enumerate(self.pool.kv_buffer):
            out[f"kv:{layer}"] = buf.view(torch.uint8).reshape(-1, PAGE * buf.shape[-1])
        for layer, buf in enumerate(self.pool.index_k_with_scale_buffer):
            if buf.numel():
                out[f"index:{layer}"] = buf.view(torch.uint8).reshape(buf.shape[0], -1)
        ptrs = self.metadata.get_buf_infos()[0]
        by_ptr = {b.data_ptr(): b for b in vars(self.metadata).values()
                  if isinstance(b, torch.Tensor)}
        for i, ptr in enumerate(ptrs):
            buf = by_ptr[ptr]
            out[f"aux:{i}"] = buf.view(torch.uint8).reshape(buf.shape[0], -1)
        return out

    def pages(self, slot: int, count: int) -> np.ndarray:
        """The pages of a request of ``count`` pages in ``slot`` (page 0: the pool's padding),
        as sglang's queues pass them (``kv_to_page_indices`` of its int32 token rows)."""
        return np.arange(1 + slot * count, 1 + (slot + 1) * count, dtype=np.int32)

    def rows(self, slot: int, count: int) -> dict[str, tuple[torch.Tensor, slice]]:
        """Per buffer: the buffer and the rows a request of ``count`` pages in ``slot`` fills
        (its pages are consecutive: views, not copies). They are set and compared through
        numpy, on this thread: torch's intra-op threads stall on a loaded 2-core host."""
        pages = slice(1 + slot * count, 1 + (slot + 1) * count)
        return {key: (buf, slice(slot, slot + 1) if key.startswith("aux") else pages)
                for key, buf in self.views().items()}

    # ---- requests ----------------------------------------------------------------------------

    def prepare(self, requests: list) -> dict:
        from sglang.srt.disaggregation.base.conn import KVPoll

        if self.role == "prefill":
            sender_class = self.kv_class(self.kinds.SENDER)
            self.requests = [(sender_class(mgr=self.manager, bootstrap_addr=self.addr,
                                           bootstrap_room=room), self.pages(slot, count), slot)
                             for room, slot, count in requests]
            wait_until(lambda: all(s.poll() != KVPoll.Bootstrapping for s, _, _ in self.requests),
                       "prefill bootstrap")
            self.raise_failed("bootstrap")
            return {}
        receiver_class = self.kv_class(self.kinds.RECEIVER)
        wait_until(lambda: self.manager.try_ensure_parallel_info(self.addr), "prefill parallel info")
        self.requests = []
        for room, slot, count in requests:
            for buf, rows in self.rows(slot, count).values():
                buf.numpy()[rows] = SENTINEL
            receiver = receiver_class(mgr=self.manager, bootstrap_addr=self.addr,
                                      bootstrap_room=room)
            receiver.init(0)
            self.requests.append((receiver, self.pages(slot, count), slot))
        wait_until(lambda: all(r.poll() != KVPoll.Bootstrapping for r, _, _ in self.requests),
                   "decode bootstrap")
        self.raise_failed("bootstrap")
        for receiver, pages, slot in self.requests:
            receiver.send_metadata(pages, slot, [pages])
        return {}

    def raise_failed(self, phase: str) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        for handle, _, _ in self.requests:
            if handle.poll() == KVPoll.Failed:
                raise RuntimeError(f"{self.role} {phase} failed: {reason_of(handle)}")

    def go(self, busy: bool = False) -> dict:
        """Prefill's timed window: every request sent, then polled to Success."""
        threads, start, cpu = snapshot(), time.monotonic(), time.process_time()
        for sender, pages, slot in self.requests:
            sender.init(len(pages), slot)
            sender.send(pages, [pages])
        ended = self.poll_to_end(busy)
        return {"start": start, "end": ended, "cpu_s": time.process_time() - cpu,
                "threads": cpu_by_thread(threads, snapshot())}

    def wait(self, busy: bool = False) -> dict:
        """Decode's side of the window: the receivers polled to Success."""
        threads, start, cpu = snapshot(), time.monotonic(), time.process_time()
        ended = self.poll_to_end(busy)
        return {"start": start, "end": ended, "cpu_s": time.process_time() - cpu,
                "threads": cpu_by_thread(threads, snapshot())}

    def poll_to_end(self, busy: bool = False) -> float:
        """Poll every request until each is Success or Failed (raised); the time the last one
        was seen Success. Each is cleared, as sglang's queues do. Between passes: ``POLL_S``
        asleep, or (``busy``) only ``time.sleep(0)``, as sglang's scheduler loop while a
        transfer is in flight (``event_loop_normal_disagg_decode`` calls ``Scheduler.on_idle``,
        which in PD mode sleeps 0 s: "transfer workers need the GIL between I/O calls")."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        done: dict[int, float] = {}
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while len(done) < len(self.requests):
            for i, (handle, _, _) in enumerate(self.requests):
                if i not in done and handle.poll() in (KVPoll.Success, KVPoll.Failed):
                    done[i] = time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role}: requests not done in {STEP_TIMEOUT_S:.0f} s")
            time.sleep(0 if busy else POLL_S)
        self.raise_failed("transfer")
        for handle, _, _ in self.requests:
            handle.clear()
        return max(done.values())

    def verify(self) -> dict:
        """Decode: each slot of the round against prefill's bytes."""
        mismatched, nbytes = [], 0
        for _, pages, slot in self.requests:
            for key, (buf, rows) in self.rows(slot, len(pages)).items():
                got = buf.numpy()[rows]
                nbytes += got.size
                if not np.array_equal(got, self.expected[key].numpy()[rows]):
                    mismatched.append(f"slot {slot} {key}")
        return {"mismatched": mismatched, "nbytes": nbytes}

    def close(self) -> None:
        shutdown = getattr(getattr(self, "manager", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        if getattr(self, "server", None) is not None:
            self.server.close()


def serve(control: str, role: str) -> int:
    """The rank's command loop; it ends on ``quit`` or when its parent is gone."""
    rank = Rank(role)
    try:
        return serve_commands(control, {"setup": rank.setup, "prepare": rank.prepare,
                                        "go": rank.go, "wait": rank.wait, "verify": rank.verify})
    finally:
        rank.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a sglang PD rank of dsa-bridge bench")
    parser.add_argument("--control", required=True, help="the bench process's ZMQ endpoint")
    parser.add_argument("--role", required=True, choices=("prefill", "decode"))
    args = parser.parse_args(argv)
    cpu_shims()
    return serve(args.control, args.role)


if __name__ == "__main__":
    sys.exit(main())

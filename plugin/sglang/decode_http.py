"""A decode rank's HTTP calls off sglang's scheduler thread (``manager.py``).

``DecodeHttp``, one per decode rank: the threads sglang's decode queue runs its HTTP calls on
(``executor``, sglang's ``_ensure_prefill_recompute_executor``: its prefill DP-rank queries and
the rebootstrap), made on first use; the rebootstrap of a retracted request
(``submit_prefill_recompute``: ``POST /generate`` at the HTTP port the prefill registered; a
prefill that cannot be asked, or refuses, fails the request); and telling a prefill that runs sglang's own
connector that a room was refused (``tell_sglang_prefill``: ``mixed.PrefillAborts``, made on first
use).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import requests
from sglang.srt.disaggregation.base.conn import BaseKVReceiver
from sglang.srt.utils.network import NetworkAddress

from .mixed import PrefillAborts

HTTP_WORKERS = 4  # threads for sglang's HTTP calls off its scheduler thread (DP-rank queries, rebootstrap)


class DecodeHttp:
    """A decode rank's HTTP calls (module docstring): ``name`` names its threads, ``waiting_s``
    bounds each (sglang's waiting timeout), and ``prefill_info(addr)`` is the prefill's registered
    parallel info (None if unknown)."""

    def __init__(self, name: str, *, waiting_s: float, prefill_info: Callable[[str], object | None]):
        self.name, self.waiting_s = name, waiting_s
        self.prefill_info = prefill_info
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.prefill_aborts: PrefillAborts | None = None  # sglang's own prefills told

    def executor(self) -> ThreadPoolExecutor:
        """The threads, made on first use, as sglang's own managers make them."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix=f"{self.name}-http")
            return self._executor

    def submit_prefill_recompute(self, receiver: BaseKVReceiver, payload: dict) -> None:
        """Ask the request's prefill to compute it again (module docstring), off sglang's thread."""
        port = getattr(self.prefill_info(receiver.bootstrap_addr), "prefill_http_port", None)
        if port is None:
            receiver.fail_recompute(f"rebootstrap: the prefill at {receiver.bootstrap_addr} "
                                    "registered no HTTP port to ask for the request again")
            return
        host = NetworkAddress.parse(receiver.bootstrap_addr).host
        url = NetworkAddress(host, int(port)).to_url() + "/generate"
        self.executor().submit(self._recompute, receiver, url, payload)

    def _recompute(self, receiver: BaseKVReceiver, url: str, payload: dict) -> None:
        """One rebootstrap ``POST`` (an HTTP thread), bounded by sglang's waiting timeout."""
        try:
            response = requests.post(url, json=payload, timeout=self.waiting_s)
        except requests.RequestException as exc:
            receiver.fail_recompute(f"rebootstrap: POST {url} failed: {exc}")
            return
        if response.status_code >= 400:
            receiver.fail_recompute(f"rebootstrap: POST {url} answered {response.status_code} "
                                    f"{response.text[:200]}")

    def tell_sglang_prefill(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """This rank refused ``room`` of the prefill at ``bootstrap_addr`` for ``reason``: if that
        prefill runs sglang's own connector, its ranks are told in sglang's protocol."""
        with self._lock:
            if self.prefill_aborts is None:
                self.prefill_aborts = PrefillAborts()
        self.prefill_aborts.notify(bootstrap_addr, room, reason)

    def close(self) -> None:
        """Stop telling; the threads are not joined (a rebootstrap POST may wait for its prefill)."""
        if self.prefill_aborts is not None:
            self.prefill_aborts.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

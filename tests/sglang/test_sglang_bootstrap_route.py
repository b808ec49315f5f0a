"""A prefill rank's registration ``PUT`` into sglang's bootstrap server
(``plugin/sglang/bootstrap_route.put_route``) against a real HTTP server on 127.0.0.1 that is
slow or refuses: a slow answer (CPU starvation: the PUT times out) is retried with backoff,
bounded by ``REGISTER_WAIT_S``, and a rank that never got through fails in one line naming the
attempts and the last error; a refusal (a status other than 200) is not retried."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from dsa_bridge.plugin.sglang import bootstrap_route  # noqa: E402

TIMEOUT_S = 0.2  # the PUT's own timeout in these tests (HTTP_TIMEOUT_S)


class Registry(http.server.ThreadingHTTPServer):
    """A bootstrap server whose first ``slow`` PUTs answer after ``delay_s`` (past the PUT's
    timeout), then with ``status``; the bodies it got, in order."""

    daemon_threads = True

    def __init__(self, slow: int, delay_s: float, status: int = 200):
        self.slow, self.delay_s, self.status = slow, delay_s, status
        self.bodies: list[bytes] = []
        super().__init__(("127.0.0.1", 0), Handler)

    def handle_error(self, request, client_address):  # a PUT that timed out: its client is gone
        pass

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/route"


class Handler(http.server.BaseHTTPRequestHandler):
    def do_PUT(self):  # noqa: N802 (http.server's name)
        server = self.server
        body = self.rfile.read(int(self.headers["Content-Length"]))
        server.bodies.append(body)
        if len(server.bodies) <= server.slow:
            time.sleep(server.delay_s)
        self.send_response(server.status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(bootstrap_route, "HTTP_TIMEOUT_S", TIMEOUT_S)
    made = []

    def start(slow: int, delay_s: float = 3 * TIMEOUT_S, status: int = 200) -> Registry:
        server = Registry(slow, delay_s, status)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        made.append(server)
        return server

    yield start
    for server in made:
        server.shutdown()
        server.server_close()


def test_a_put_that_times_out_is_retried_until_the_server_answers(registry):
    server = registry(slow=2)
    started = time.monotonic()
    bootstrap_route.put_route(server.url, {"rank_port": 1})
    assert len(server.bodies) == 3 and len(set(server.bodies)) == 1  # the same row, three times
    assert time.monotonic() - started < bootstrap_route.REGISTER_WAIT_S


def test_a_server_that_never_answers_in_time_fails_the_rank_by_the_bound_naming_the_last_error(
        registry, monkeypatch):
    monkeypatch.setattr(bootstrap_route, "REGISTER_WAIT_S", 1.5)
    server = registry(slow=1000)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        bootstrap_route.put_route(server.url, {"rank_port": 1})
    took = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message and server.url in message
    assert f"{len(server.bodies)} attempt(s)" in message and "ReadTimeout" in message
    assert 1.5 <= took < 1.5 + 2 * TIMEOUT_S + 1.0  # the bound, then at most one more attempt
    assert len(server.bodies) >= 3  # retried, with backoff (not one attempt per few ms)
    assert len(server.bodies) < 1.5 / TIMEOUT_S + 2


def test_a_refusal_is_not_retried(registry):
    server = registry(slow=0, status=400)
    with pytest.raises(RuntimeError, match="refused this prefill rank: 400"):
        bootstrap_route.put_route(server.url, {"rank_port": 1})
    assert len(server.bodies) == 1

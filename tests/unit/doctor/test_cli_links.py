"""`kvgate doctor` against real loopback servers that are not a healthy gateway: a link that
trickles the answer, a server answering a doctor-shaped but incomplete report. Each is one
line on stderr and exit status 1, within the --timeout asked for."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.doctor import cli

TOKEN = ["--admin-token", "x" * 24]


class _Answer(BaseHTTPRequestHandler):
    trickle_s = 0.0  # > 0: send the body one byte per this many seconds
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        try:
            for i in range(len(self.body)):
                self.wfile.write(self.body[i:i + 1])
                self.wfile.flush()
                time.sleep(self.trickle_s)
        except OSError:
            pass  # the CLI gave up

    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type[_Answer]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def trickling() -> Iterator[str]:
    class Slow(_Answer):
        trickle_s = 0.1
        body = json.dumps({"object": "doctor"}).encode() * 10

    yield from _serve(Slow)


@pytest.fixture
def slow_headers() -> Iterator[str]:
    """Its response head comes a byte every 0.05 s (5 s in all): each read is quick."""

    class SlowHead(_Answer):
        def do_GET(self) -> None:
            head = b"HTTP/1.1 200 OK\r\nx-pad: " + b"a" * 80 + b"\r\ncontent-length: 2\r\n\r\n{}"
            try:
                for i in range(len(head)):
                    self.wfile.write(head[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass  # the CLI gave up

    yield from _serve(SlowHead)


def test_a_link_trickling_its_headers_times_out_within_the_timeout(
        slow_headers: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Only the body was held to the deadline: headers trickling in took their whole 5 s."""
    start = time.monotonic()
    assert cli.main(["--url", slow_headers, "--timeout", "0.5", *TOKEN]) == 1
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert took < 1.5, took
    assert out == "" and err == f"kvgate doctor: {slow_headers} did not answer within 0.5 s\n"


@pytest.fixture
def incomplete() -> Iterator[str]:
    class Partial(_Answer):
        body = json.dumps({"object": "doctor", "findings": []}).encode()

    yield from _serve(Partial)


def test_a_trickling_link_times_out_within_the_timeout(
        trickling: str, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    assert cli.main(["--url", trickling, "--timeout", "0.5", *TOKEN]) == 1
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert took < 2.0  # not one read timeout per byte (the body takes 20 s)
    assert out == "" and err == f"kvgate doctor: {trickling} did not answer within 0.5 s\n"


def test_an_incomplete_report_is_one_line_not_a_traceback(
        incomplete: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--url", incomplete, *TOKEN]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "incomplete doctor report (no window, history, worst, cache)" in err


@pytest.fixture
def twelve_workers() -> Iterator[str]:
    """A gateway of 12 workers as the doctor sees it: each request answered by the next."""
    turn = iter(range(1_000))

    class Worker(_Answer):
        def do_GET(self) -> None:
            worker = next(turn) % 12
            self.body = json.dumps({
                "object": "doctor", "window": "5m", "history": {}, "worst": {}, "findings": [],
                "cache": {}, "process": {"workers": 12, "worker": worker}}).encode()
            super().do_GET()

    yield from _serve(Worker)


def test_the_workers_reports_are_in_numeric_order(
        twelve_workers: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--url", twelve_workers, "--json", *TOKEN]) == 0
    out, _ = capsys.readouterr()
    both = json.loads(out)
    assert both["missing"] == []
    assert [r["process"]["worker"] for r in both["data"]] == list(range(12))  # 2 before 10


@pytest.fixture
def slow_workers() -> Iterator[str]:
    """A gateway of 2 workers whose every report takes 2.5 s, always from worker 0 (the
    kernel may hand every new connection to the same worker)."""

    class Slow(_Answer):
        body = json.dumps({
            "object": "doctor", "window": "5m", "history": {}, "worst": {}, "findings": [],
            "cache": {}, "process": {"workers": 2, "worker": 0}}).encode()

        def do_GET(self) -> None:
            time.sleep(2.5)
            super().do_GET()

    yield from _serve(Slow)


def test_several_workers_are_gathered_within_one_timeout(
        slow_workers: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--timeout is the whole run's: the first report and the search for the other workers'
    together (the search had a --timeout of its own: 5.5 s here for a --timeout of 3; the
    margin, half a report, holds on a loaded machine, where 1.3 s for a --timeout of 1 did
    not)."""
    start = time.monotonic()
    assert cli.main(["--url", slow_workers, "--timeout", "3", "--json", *TOKEN]) == 0
    took = time.monotonic() - start
    out, _ = capsys.readouterr()
    assert json.loads(out)["missing"] == [1]  # worker 1 never answered: shown as missing
    assert took < 3 + 2.5 / 2, took

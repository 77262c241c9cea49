"""`server.workers`: a worker asks the kernel to stop it when its supervisor dies (SIGKILL
included), a few milliseconds after it was forked. A supervisor killed within those
milliseconds (`kill -9` of the gateway just as it restarts a worker) left that worker
running with nobody to stop it: it served the port as an orphan, for good. Such a worker now
sees, once it asked, that its supervisor is no longer its parent, and exits without serving.
(The window is too short to hit on purpose: the worker is given a supervisor that is not its
parent, which is what it sees when the real one died first.)"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from pathlib import Path

from gateway.config import KvgateConfig, load_config
from gateway.worker_metrics import WorkerSlot
from gateway.workers import _worker


def test_a_worker_whose_supervisor_died_before_it_could_follow_it_does_not_serve(
    tmp_path: Path,
) -> None:
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"replicas": ["http://127.0.0.1:9"], "served_model": "m"}},
        "models": {"m": {"default": "p"}}, "server": {"workers": 2},
        "redis_url": "redis://127.0.0.1:9"})
    served = tmp_path / "served"
    shared = tmp_path / "shared"
    shared.mkdir()

    def serve(_cfg: KvgateConfig, _sockets: list[socket.socket],
              _on_started: Callable[[], None]) -> int:
        served.write_text("it served")
        return 0

    ctx = multiprocessing.get_context("fork")
    gone = os.getppid()  # the supervisor it was forked by: not its parent any more
    proc = ctx.Process(target=_worker, args=(serve, cfg, [], WorkerSlot(0, shared),
                                             ctx.Event(), gone))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    assert not served.exists()
    assert not shared.exists()  # the tenancy state it would share goes with the supervisor

"""`kvgate demo` says when one of its simulated replicas exits (killed to watch a failover, or
crashed), reaps it, and gives the command that starts it again on its port; that command
works. Before, the process stayed a zombie and the demo said nothing."""

from __future__ import annotations

import os
import re
import shlex
import signal
from pathlib import Path

import httpx

from tests.support.gateway import wait_for
from tests.support.procs import KVGATE, Proc

UP = r"kvgate is up: http://127\.0\.0\.1:(\d+)/v1"
EXITED = r"the simulated replica on 127\.0\.0\.1:(\d+) exited \(status -9\).*\n  (kvgate sim .*)"


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False


def test_a_killed_replica_is_said_reaped_and_can_be_started_again() -> None:
    demo = Proc([*KVGATE, "demo", "--port", "0", "--time-scale", "50"],
                env={"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": ""})
    with demo:
        wait_for(lambda: re.search(UP, demo.output()) is not None, timeout=60, what="the banner")
        assert demo.popen is not None
        children = _children(demo.popen.pid)
        assert len(children) == 4, children
        victim = children[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: re.search(EXITED, demo.output()) is not None, timeout=15,
                 what="the demo saying the replica exited")
        found = re.search(EXITED, demo.output())
        assert found is not None
        assert not _zombie(victim)
        assert demo.output().count("exited (status") == 1  # said once
        argv = shlex.split(found[2])
        assert argv[argv.index("--port") + 1] == found[1]
        again = Proc([*KVGATE, *argv[1:]], ready_url=f"http://127.0.0.1:{found[1]}/health")
        with again:
            assert httpx.get(f"http://127.0.0.1:{found[1]}/health", timeout=5).status_code == 200

"""The real `kvgate serve` given its own address in a spelling the check missed:
``--upstream http://127.1:P`` beside ``--port P`` started and sent each request back to
itself, hop after hop, until the client gave up. Now it refuses to start, naming it."""

from __future__ import annotations

import pytest

from tests.integration.test_cli_own_address import kvgate
from tests.support.procs import free_port


@pytest.mark.parametrize("host", ["127.1", "[::ffff:127.0.0.1]"])
def test_serve_refuses_its_own_port_spelt_otherwise(host: str) -> None:
    port = free_port()
    result = kvgate("serve", "--no-auth", "--port", str(port),
                    "--upstream", f"http://{host}:{port}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"kvgate serve: pools.default: the replica http://{host}:{port} is this gateway's "
        f"own address (server.port {port})")
    assert "listening on" not in result.stderr and "Traceback" not in result.stderr

"""Start either edge over one config: `kvgate serve`, or `kvgate epp` behind a real Envoy.

Tests that check a behaviour at both edges parametrise over the edge's name and start it with
`running_edge` (or `start_edge` where the test's `procs` list stops what it started). The
names the tests use are kept: ``"http"`` or ``"serve"`` for the HTTP edge, ``"envoy"`` for
the picker behind Envoy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

__all__ = ["ENVOY", "HTTP_EDGES", "EdgeBases", "running_edge", "running_edges", "start_edge",
           "start_edges"]

ENVOY = "envoy"
HTTP_EDGES = frozenset({"http", "serve"})


class EdgeBases(NamedTuple):
    """Where clients call (``base``) and where the edge's /metrics and admin API are
    (``admin``: the gateway itself, or the picker's HTTP port behind Envoy)."""

    base: str
    admin: str


def start_edge(
    edge: str, procs: list[Proc], *, config: dict[str, Any] | None = None,
    upstreams: Sequence[str] = (), env: dict[str, str] | None = None, auth: bool = False,
    picker: Mapping[str, Any] | None = None, **envoy: Any,
) -> EdgeBases:
    """Start `edge` over `config` (or the quick form's `upstreams`), appending each process
    to `procs` once started (the caller stops them, last first). Behind Envoy the picker's
    config also gets the sections in `picker` (e.g. ``{"epp": {"fallbacks": 1}}``) and
    `envoy` goes to `envoy_config` (e.g. ``endpoints=[...]``)."""
    if edge in HTTP_EDGES:
        gw, base = gateway_proc(config=config, upstreams=upstreams, env=env, auth=auth)
        procs.append(gw.start())
        return EdgeBases(base, base)
    assert edge == ENVOY, f"no edge named {edge!r}"
    picked = None if config is None else {**config, **(picker or {})}
    epp = epp_proc(config=picked, upstreams=upstreams, env=env, auth=auth)
    procs.append(epp.start())
    proxy, base = envoy_proc(epp.picker, **envoy)
    procs.append(proxy.start())
    return EdgeBases(base, epp.base)


@contextmanager
def running_edge(
    edge: str, *, config: dict[str, Any] | None = None, upstreams: Sequence[str] = (),
    env: dict[str, str] | None = None, auth: bool = False,
    picker: Mapping[str, Any] | None = None, **envoy: Any,
) -> Iterator[EdgeBases]:
    """`start_edge` for the length of a ``with`` block: its processes stopped (and their
    files removed) at its end, last first."""
    with _closing() as procs:
        yield start_edge(edge, procs, config=config, upstreams=upstreams, env=env, auth=auth,
                         picker=picker, **envoy)


@contextmanager
def running_edges(**options: Any) -> Iterator[dict[str, EdgeBases]]:
    """Both edges at once, each started as `start_edge` starts it with `options`:
    ``{"http": ..., "envoy": ...}``."""
    with _closing() as procs:
        yield start_edges(procs, **options)


def start_edges(procs: list[Proc], **options: Any) -> dict[str, EdgeBases]:
    """Both edges, each started into `procs` as `start_edge` starts it with `options`:
    ``{"http": ..., "envoy": ...}``."""
    return {edge: start_edge(edge, procs, **options) for edge in ("http", ENVOY)}


@contextmanager
def _closing() -> Iterator[list[Proc]]:
    """A list to start processes into, each stopped (its files removed) at the end, last
    first -- also when a start fails half way."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            proc.close()

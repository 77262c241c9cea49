"""How both edges read a request's path before matching a route, and what they say about a
path that matches none.

- Runs of slashes are one slash: ``//v1/chat/completions`` (a base URL written
  ``http://host:8000/`` + ``/v1``, or ending in ``/v1/``) is ``/v1/chat/completions``. vLLM
  does not do this (Starlette matches the path as sent: its 404 ``{"detail": "Not Found"}``),
  but no route of kvgate's or vLLM's has an empty segment, so nothing else could be meant;
  the replica is sent the route's own path.
- Under ``/v1/``, one trailing slash is dropped: vLLM (FastAPI) redirects
  ``/v1/chat/completions/`` to the route and clients follow it with the body, so kvgate
  serves it as the route without the round trip; ``GET /v1/models/m/`` is model ``m`` (a
  model name may hold ``/``, never end with one).
- kvgate's own pages (``/healthz``, ``/livez``, ``/readyz``, ``/metrics`` and vLLM's
  ``/health``, ``/ping``, ``/version``) drop one trailing slash too, on the API port and the
  admin port alike: a probe or a ``curl`` following vLLM's redirect asks ``/healthz/`` (the
  admin port answered it 404 while the API port served it).
- Under ``/v1/responses/{id}``, only ``/cancel`` is a route (vLLM 0.34's; OpenAI's
  ``input_items``, which the SDK's ``responses.input_items.list`` asks for, is not): any
  other sub-path is a 404 naming the two stored-response routes.
- A path with something before an API route (``/openai/v1/chat/completions``: a base URL
  copied from another provider's, or a proxy's prefix left on) is a 404 that says to use the
  base URL ``http://HOST:PORT/v1``; a doubled ``/v1/v1/...`` (a client that adds ``/v1``
  given a base URL ending in it) says so.
"""

from __future__ import annotations

import re

from gateway.errors import NotFound, shown_name
from gateway.proxy import KINDS, MODEL_PREFIX, MODELS
from gateway.stored import match_stored

__all__ = ["API_PREFIX", "api_route", "canonical", "deployment_route", "prefixed_route",
           "stored_subroute"]

API_PREFIX = "/v1/"
_SLASHES = re.compile(r"/{2,}")
_PAGES = frozenset({"/healthz", "/livez", "/readyz", "/metrics", "/health", "/ping", "/version"})


def canonical(path: str) -> str:
    """The path routes are matched against (the same string when it is already canonical)."""
    if "//" in path:
        path = _SLASHES.sub("/", path)
    if path[-1:] == "/" and (path.startswith(API_PREFIX) or path[:-1] in _PAGES):
        path = path[:-1]
    return path


def api_route(path: str) -> bool:
    """One of the routes clients reach under the base URL (proxied, models, stored)."""
    return path in KINDS or path == MODELS or path.startswith(MODEL_PREFIX) \
        or match_stored(path)


def prefixed_route(path: str) -> NotFound | None:
    """The 404 for an API route asked under a prefix (``/openai/v1/chat/completions``),
    naming the base URL to use; None for any other path."""
    at = path.find(API_PREFIX, 1)
    if at < 0 or not api_route(path[at:]):
        return None
    if path[:at].endswith("/v1"):
        # "without the /v1 prefix" read as "drop /v1": a client that adds /v1 itself (some
        # frameworks' OpenAI-compatible providers do) was given a base URL ending in /v1
        return NotFound(f"Unknown path {shown_name(path)}: /v1 appears twice. kvgate serves "
                        f"the OpenAI API at {shown_name(path[at:])}: use the base URL "
                        "http://HOST:PORT/v1, or http://HOST:PORT with a client that adds "
                        "/v1 itself.")
    return NotFound(f"Unknown path {shown_name(path)}: kvgate serves the OpenAI API at "
                    f"{shown_name(path[at:])}, without the {shown_name(path[:at])} prefix. Use "
                    "the base URL http://HOST:PORT/v1 (your client adds the rest).")


_STORED = "/v1/responses/"


def stored_subroute(path: str) -> NotFound | None:
    """The 404 for a path under a stored response that is no route (``.../input_items``);
    None for ``/v1/responses/{id}`` and ``.../cancel`` (`gateway.stored` serves them)."""
    rest = path[len(_STORED):].partition("/")[2] if match_stored(path) else ""
    if not rest or rest == "cancel":
        return None
    return NotFound(f"Unknown path {shown_name(path)}: kvgate serves GET /v1/responses/{{id}} "
                    "and POST /v1/responses/{id}/cancel of a stored response, as vLLM does.")


_DEPLOYMENT = re.compile(r"/deployments/([^/]*)(/.*)?$")


def deployment_route(path: str) -> NotFound | None:
    """The 404 for an AzureOpenAI client's path (``/openai/deployments/NAME/chat/completions``),
    naming kvgate's route for it and the deployment's name as the model; None for any other
    path. (It said to use a base URL ending in /v1 without naming the route or the model.)"""
    found = _DEPLOYMENT.search(path)
    if found is None:
        return None
    name, rest = found.group(1), found.group(2) or ""
    route = f"/v1{rest}"
    served = (f" ({shown_name(route)}, with model `{shown_name(name)}`)"
              if name and api_route(route) else "")
    return NotFound(f"Unknown path {shown_name(path)}: kvgate serves OpenAI's paths{served}, "
                    "not Azure OpenAI's deployments. Use the OpenAI client with a base URL "
                    "ending in /v1 (the key may stay in the api-key header).")

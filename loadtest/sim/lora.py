"""LoRA adapters as a vLLM replica started with ``--enable-lora`` serves them.

What the simulator follows (vLLM 0.34's models serving module and prefix-cache hashing):
``--lora-modules name=path`` adapters are served beside the base model; ``/v1/models`` lists
a card per adapter (``root`` its path, ``parent`` the base model's first served name, no
``max_model_len``); a request naming an adapter is accepted and answered under the adapter's
name; its KV blocks are not the base model's (vLLM's block hash carries the LoRA name in its
first block's extra keys, so the simulated cache keys it like a salt); ``POST
/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and remove adapters at run time
(vLLM: with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; here whenever LoRA is enabled), answered in
plain text, a duplicate load 400 and an unknown unload 404. No adapter weights exist: an
adapter computes as its base model does.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson

from loadtest.sim.asgi import Receive, Scope, Send, read_body, send_bytes
from loadtest.sim.errors import SimError

if TYPE_CHECKING:
    from loadtest.sim.app import Handler

__all__ = ["LoraAdapters", "parse_lora_modules"]

_TEXT = (b"content-type", b"text/plain; charset=utf-8")


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """``--lora-modules`` values: ``name=path`` or vLLM's JSON form ``{"name": .., "path":
    ..}`` (ValueError naming the value otherwise)."""
    adapters: dict[str, str] = {}
    for value in values:
        if value.startswith("{"):
            try:
                spec = orjson.loads(value)
                name, path = spec["name"], spec["path"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: JSON needs 'name' and 'path'"
                                 ) from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {value!r}: write name=path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {value!r}: a name and a path")
        adapters[name] = path
    return adapters


class LoraAdapters:
    """The adapters one replica serves (by name -> path), changed at run time."""

    def __init__(self, enabled: bool, base: str, adapters: dict[str, str],
                 max_loras: int = 1) -> None:
        self.enabled, self.base, self.paths = enabled, base, dict(adapters)
        self.max_loras = max_loras
        self.in_flight: Counter[str] = Counter()  # adapter -> its requests in flight

    def info(self) -> tuple[int, list[str]]:
        """(--max-loras, the adapters with requests in flight) for vllm:lora_requests_info."""
        return self.max_loras, sorted(a for a, n in self.in_flight.items() if n)

    def get(self, model: object) -> str | None:
        """``model`` when it names one of the adapters, else None."""
        return model if isinstance(model, str) and model in self.paths else None

    def cards(self, now: int, permission: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": now, "owned_by": "vllm",
                 "root": path, "parent": self.base, "max_model_len": None,
                 "permission": [permission]} for name, path in self.paths.items()]

    def routes(self) -> dict[tuple[str, str], Handler]:
        if not self.enabled:  # (vLLM registers them for a LoRA-enabled server only)
            return {}
        return {("POST", "/v1/load_lora_adapter"): self._load,
                ("POST", "/v1/unload_lora_adapter"): self._unload}

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        name, path = _fields(await read_body(receive), "lora_path")
        if name in self.paths:
            raise SimError(400, f"The lora adapter '{name}' has already been loaded.",
                           "InvalidUserInput", "lora_name")
        self.paths[name] = path
        await send_bytes(send, 200, f"Success: LoRA adapter '{name}' added successfully."
                         .encode(), _TEXT)

    async def _unload(self, scope: Scope, receive: Receive, send: Send) -> None:
        name, _ = _fields(await read_body(receive), None)
        if self.paths.pop(name, None) is None:
            raise SimError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError",
                           "lora_name")
        await send_bytes(send, 200, f"Success: LoRA adapter '{name}' removed successfully."
                         .encode(), _TEXT)


def _fields(raw: bytes, path_field: str | None) -> tuple[str, str]:
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        raise SimError(400, "1 validation error: the body must be a JSON object", "Bad Request")
    name, path = body.get("lora_name"), body.get(path_field) if path_field else "-"
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise SimError(400, "Both 'lora_name' and 'lora_path' must be provided." if path_field
                       else "'lora_name' needs to be provided to unload a LoRA adapter.",
                       "InvalidUserInput")
    return name, path

"""Small builders shared by the routing unit tests."""

from __future__ import annotations

from routing.config import RouterConfig
from routing.features import extract_features
from routing.types import ReplicaView, RequestFeatures

CFG = RouterConfig()


def chat(*contents: str, system: str = "") -> dict[str, object]:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": c} for c in contents]
    return {"model": "m", "messages": messages}


def feats(text: str, *, salt: str = "s", config: RouterConfig = CFG) -> RequestFeatures:
    return extract_features({"prompt": text}, model="m", salt=salt, config=config)


def views(n: int, **kw: object) -> list[ReplicaView]:
    return [ReplicaView(id=f"r{i}", pool="p", **kw) for i in range(n)]  # type: ignore[arg-type]

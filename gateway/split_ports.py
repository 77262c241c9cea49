"""The admin port's 404 (`server.admin_port`): it serves no OpenAI route, and an OpenAI client
given its address got "Unknown path /v1/chat/completions on the admin port.", which did not
say where those go. (The public port's 404 for /metrics or /admin says nothing of the admin
port on purpose: the public Service is the internet's.)"""

from __future__ import annotations

from gateway.errors import NotFound, shown_name

__all__ = ["on_admin_port"]


def on_admin_port(path: str) -> NotFound:
    """Any path the admin port does not serve; an OpenAI route says where those go."""
    if path == "/v1" or path.startswith("/v1/"):
        return NotFound(f"Unknown path {shown_name(path)} on the admin port: it serves the "
                        "admin API, /metrics, /healthz, /livez and /readyz only; OpenAI "
                        "requests go to the gateway's API port (server.port; behind Envoy: "
                        "Envoy's listener).")
    return NotFound(f"Unknown path {shown_name(path)} on the admin port.")

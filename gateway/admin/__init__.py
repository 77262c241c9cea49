"""kvgate's admin API: a router factory the gateway mounts, and a standalone app."""

from gateway.admin.app import create_admin_app
from gateway.admin.auth import AdminToken, admin_tokens_from_env, check_admin
from gateway.admin.deps import AdminDeps
from gateway.admin.routes import make_admin_router

__all__ = [
    "AdminDeps",
    "AdminToken",
    "admin_tokens_from_env",
    "check_admin",
    "create_admin_app",
    "make_admin_router",
]

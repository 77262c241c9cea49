"""A standalone app serving only the admin API (tests, or a separate admin port)."""

from __future__ import annotations

from fastapi import FastAPI

from gateway.admin.routes import AdminDeps, make_admin_router

__all__ = ["create_admin_app"]


def create_admin_app(deps: AdminDeps) -> FastAPI:
    app = FastAPI(title="kvgate admin API", version="1")
    app.include_router(make_admin_router(deps))
    return app

"""The URL table; the views live in ``gateway.views``."""
from __future__ import annotations

from aiohttp import web

from gateway import views
from gateway.openapi import PATH as OPENAPI_PATH


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", views.list_models)
    app.router.add_get("/v1/models/{model}", views.get_model)
    app.router.add_post("/v1/chat/completions", views.chat_completions)
    app.router.add_post("/v1/completions", views.completions)
    app.router.add_get("/health", views.health)
    app.router.add_get("/metrics", views.metrics)
    app.router.add_get("/", views.status_page)              # open: a page without numbers
    app.router.add_get("/status.json", views.status_json)   # guarded like /metrics: its numbers
    app.router.add_get(OPENAPI_PATH, views.openapi_json)  # open, like /health (gateway.auth.OPEN_PATHS)

"""Typed application and request keys shared by the app factory, the middlewares and the views."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.apikeys import KeyStore
    from gateway.config import GatewayConfig
    from gateway.history import History
    from gateway.ratelimit import Admission
    from gateway.serving import Service

CONFIG: web.AppKey["GatewayConfig"] = web.AppKey("config")
SERVICE: web.AppKey["Service"] = web.AppKey("service")
KEYS: web.AppKey["KeyStore"] = web.AppKey("api_keys")
HISTORY: web.AppKey["History"] = web.AppKey("history")  # the status page's charts

KEY_ID: web.RequestKey[str] = web.RequestKey("key_id")                  # the caller's key id
ADMISSION: web.RequestKey["Admission"] = web.RequestKey("admission")   # its last rate-limit answer

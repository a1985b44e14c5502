"""Typed application keys shared by the app factory and the views."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.app import GatewayConfig
    from gateway.serving import Service

CONFIG: web.AppKey["GatewayConfig"] = web.AppKey("config")
SERVICE: web.AppKey["Service"] = web.AppKey("service")

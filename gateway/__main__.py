"""``python -m gateway``: the OpenAI-compatible HTTP front of MFS (aiohttp on uvloop)."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal

import structlog
import uvloop
from aiohttp import web

from core.cli import add_args, from_args
from core.logs import configure
from core.redisconn import add_redis_args, target_from_args
from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.openai_api import Limits

log = structlog.get_logger("gateway")


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_redis_args(p)
    groups = {
        "multi-level sampling": p.add_argument_group(
            "multi-level sampling", "server defaults; a request's \"mfs\" body field overrides them (see "
                                    "gateway/README.md)"),
        "access": p.add_argument_group("access", "API keys also come from MFS_API_KEYS (comma-separated); "
                                                 "with no key at all the gateway is open"),
        "bounds": p.add_argument_group("bounds", "a request past one gets a 400 naming the parameter"),
    }
    add_args(p, GatewayConfig, groups)
    add_args(p, Limits, groups)
    a = p.parse_args(argv)
    env_keys = [k.strip() for k in os.environ.get("MFS_API_KEYS", "").split(",") if k.strip()]
    target = target_from_args(a)
    return from_args(GatewayConfig, a, redis_url=target.as_url(), redis_timeout_s=target.timeout_s,
                     api_keys=env_keys, limits=from_args(Limits, a))


async def serve(cfg: GatewayConfig) -> None:
    runner = web.AppRunner(init_app(cfg), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    log.info("gateway.listening", url=f"http://{cfg.host}:{cfg.port}", gateway_id=cfg.gateway_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("gateway.stopping", gateway_id=cfg.gateway_id)
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    configure(json_lines=True)
    cfg = parse_args(argv)
    uvloop.run(serve(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

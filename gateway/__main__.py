"""``python -m gateway``: the OpenAI-compatible HTTP front of MFS (aiohttp on uvloop)."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal

import structlog
import uvloop
from aiohttp import web

from core.logs import configure
from core.redisconn import add_redis_args, target_from_args
from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.complexity import ComplexityConfig
from gateway.openai_api import Limits

log = structlog.get_logger("gateway")


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    p.add_argument("--model", default="default", help="default | default-raw | checkpoint dir | HF dir | .gguf")
    p.add_argument("--tiers", default=None, help="tier cut, e.g. 10,20,30 (see mfs tiers)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    add_redis_args(p)
    p.add_argument("--gateway-id", default=None, help="names this gateway's stream mfs:out:{ID}")
    p.add_argument("--max-inflight", type=int, default=256, help="in-flight requests before 429")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--stall-timeout", type=float, default=15.0,
                   help="after a Redis outage or restart, fail (503, retryable) a request in flight that "
                        "gets no token event within this many seconds of Redis being back")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="cap for chat requests without max_tokens (default: the rest of the context)")
    p.add_argument("--complexity-config", default=None,
                   help="JSON file or inline JSON object overriding the complexity scorer's settings")
    m = p.add_argument_group("multi-level sampling", "server defaults; a request's \"mfs\" body field "
                             "overrides them (see gateway/README.md)")
    m.add_argument("--spec-draft-tier", default=None,
                   help="self-speculative decoding: draft with this tier (name, model id or index) and verify "
                        "with the request's tier, when the draft is below it (default: off)")
    m.add_argument("--spec-gamma", type=int, default=4, help="draft tokens per verification round (1..16)")
    m.add_argument("--cascade-threshold", type=float, default=None,
                   help="confidence cascade for requests naming the family id: escalate one tier up when "
                        "the mean top-token probability of the last --cascade-window tokens falls below "
                        "this (0 < P < 1; default: off)")
    m.add_argument("--cascade-window", type=int, default=4, help="tokens the cascade averages over (1..64)")
    g = p.add_argument_group("access", "API keys also come from MFS_API_KEYS (comma-separated); with "
                             "no key at all the gateway is open")
    g.add_argument("--api-keys-file", default=None,
                   help="one key per line, '#' comments; re-read when it changes (no restart to revoke)")
    g.add_argument("--rpm", type=int, default=0, help="requests per minute per key (0: unlimited)")
    g.add_argument("--tpm", type=int, default=0,
                   help="tokens per minute per key, prompt + max_tokens counted at admission (0: unlimited)")
    d = Limits()
    b = p.add_argument_group("bounds", "a request past one gets a 400 naming the parameter")
    b.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="characters in a prompt, or in all messages together")
    b.add_argument("--max-prompt-tokens", type=int, default=0, help="prompt tokens (0: only the context)")
    b.add_argument("--max-tokens-cap", type=int, default=0,
                   help="largest max_tokens accepted, and the cap of a defaulted one (0: only the context)")
    b.add_argument("--max-messages", type=int, default=d.max_messages)
    b.add_argument("--max-stop", type=int, default=d.max_stop, help="stop strings per request")
    b.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="characters per stop string")
    a = p.parse_args(argv)
    env_keys = [k.strip() for k in os.environ.get("MFS_API_KEYS", "").split(",") if k.strip()]
    limits = Limits(max_prompt_chars=a.max_prompt_chars, max_messages=a.max_messages, max_stop=a.max_stop,
                    max_stop_chars=a.max_stop_chars, max_tokens_cap=a.max_tokens_cap)
    target = target_from_args(a)
    cfg = GatewayConfig(model=a.model, tiers=a.tiers, host=a.host, port=a.port, redis_url=target.as_url(),
                        redis_timeout_s=target.timeout_s,
                        max_inflight=a.max_inflight, max_body_bytes=a.max_body_bytes,
                        request_timeout_s=a.request_timeout, stall_timeout_s=a.stall_timeout,
                        default_max_tokens=a.default_max_tokens,
                        complexity=ComplexityConfig.load(a.complexity_config), api_keys=env_keys,
                        api_keys_file=a.api_keys_file, rpm=a.rpm, tpm=a.tpm,
                        max_prompt_tokens=a.max_prompt_tokens, limits=limits,
                        spec_draft_tier=a.spec_draft_tier, spec_gamma=a.spec_gamma,
                        cascade_threshold=a.cascade_threshold, cascade_window=a.cascade_window)
    if a.gateway_id:
        cfg.gateway_id = a.gateway_id
    return cfg


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

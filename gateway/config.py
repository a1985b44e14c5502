"""``GatewayConfig``: everything one gateway process is configured with (``python -m gateway`` fills it
from its command line; tests build it directly). Plain data: importing it loads no HTTP framework."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from core.cli import opt
from core.params import PARAMS, default
from core.redisconn import DEFAULT_TIMEOUT_S
from gateway.complexity import ComplexityConfig
from gateway.openai_api import Limits


@dataclass(slots=True)
class GatewayConfig:
    model: str = opt("default", "default | default-raw | checkpoint dir | HF dir | .gguf")  # family/manifest.py
    tiers: str | None = opt(None, "tier cut, e.g. 10,20,30 (see mfs tiers)")  # for a non-nested checkpoint
    host: str = opt("127.0.0.1", "bind address (default: loopback only)")
    port: int = 8000
    # or redis+sentinel://H1:P1,H2:P2/MASTER/DB; both from core.redisconn's flags
    redis_url: str = opt(default_factory=lambda: os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                         cli=False)
    redis_timeout_s: float = opt(DEFAULT_TIMEOUT_S, cli=False)  # a silent Redis peer is dropped after this long
    gateway_id: str = opt(default_factory=lambda: f"gw-{uuid.uuid4().hex[:8]}",
                          help="names this gateway's stream mfs:out:{ID}")
    max_inflight: int = opt(4096, "requests in flight (waiting + running) before 429 too_many_requests: a memory "
                                  "guard; --max-waiting is the admission policy")
    # Admission (gateway/admission.py): a request waits from acceptance to its first token; past a bound, 429
    max_waiting: int | None = opt(None, "requests waiting for their first token at this gateway, all tiers, "
                                        "before 429 queue_full with Retry-After (default: 64 per CPU core)")
    max_waiting_per_tier: int = opt(0, "...and per tier (0: only the total bound)")
    max_queue_wait_s: float = opt(20.0, "...and by expected wait: 429 when the requests already waiting would "
                                        "take longer than this to start at the rate requests have been "
                                        "starting (seconds; 0: no such bound)", flag="--max-queue-wait")
    redis_pool: int = opt(64, "Redis connections this gateway's requests share; when all are busy a command "
                              "waits for one (up to 30 s, or --redis-timeout if longer) rather than failing")
    max_body_bytes: int = opt(4 << 20, "larger bodies get 413")
    request_timeout_s: float = opt(600.0, "per-request deadline (s)", flag="--request-timeout")  # then Cancel, 504
    stall_timeout_s: float = opt(15.0, "after a Redis outage or restart, fail (503, retryable) a request in "
                                       "flight that gets no token event within this many seconds of Redis "
                                       "being back", flag="--stall-timeout")
    default_max_tokens: int | None = opt(None, "cap for chat requests without max_tokens (default: the rest of "
                                               "the context)")
    api_keys: list[str] = opt(default_factory=list, cli=False)  # MFS_API_KEYS; none and no file: open
    api_keys_file: str | None = opt(None, "one key per line, '#' comments; re-read when it changes (no restart "
                                          "to revoke)", group="access")
    rpm: int = opt(0, "requests per minute per key (0: unlimited)", group="access")
    tpm: int = opt(0, "tokens per minute per key, prompt + max_tokens counted at admission (0: unlimited)",
                   group="access")
    max_prompt_tokens: int = opt(0, "prompt tokens (0: only the context)", group="bounds")
    limits: Limits = opt(default_factory=Limits, cli=False)  # bounds on one request body: its own flags
    complexity: ComplexityConfig = opt(default_factory=ComplexityConfig, parse=ComplexityConfig.load,
                                       flag="--complexity-config",
                                       help="JSON file or inline JSON object overriding the complexity "
                                            "scorer's settings")
    # Multi-level sampling defaults (a request's "mfs" body field overrides them; see README).
    # The groups ("multi-level sampling", "access", "bounds") are made in gateway/__main__.py.
    spec_draft_tier: str | int | None = opt(None, "self-speculative decoding: draft with this tier (name, model "
                                                  "id or index) and verify with the request's tier, when the "
                                                  "draft is below it (default: off)", group="multi-level sampling")
    spec_gamma: int = opt(default("spec_gamma"), "draft tokens per verification round ("
                          f"{PARAMS['spec_gamma'].bounds().strip()})", group="multi-level sampling")
    cascade_threshold: float | None = opt(default("cascade_threshold"), "confidence cascade for requests naming "
                                          "the family id: escalate one tier up when the mean top-token "
                                          "probability of the last --cascade-window tokens falls below this ("
                                          f"{PARAMS['cascade_threshold'].bounds().strip()}; default: off)",
                                          group="multi-level sampling")
    cascade_window: int = opt(default("cascade_window"), "tokens the cascade averages over ("
                              f"{PARAMS['cascade_window'].bounds().strip()})", group="multi-level sampling")
    history_period_s: float = opt(2.0, "the status page's charts: seconds between two samples of this gateway's "
                                       "metrics", flag="--history-period")
    history_span_s: float = opt(300.0, "the status page's charts: seconds of samples kept", flag="--history-span")
    reader_block_ms: int = opt(1000, cli=False)
    frontend: object | None = opt(None, cli=False)  # a loaded family.manifest.Frontend (tests share one)

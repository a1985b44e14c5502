"""``GatewayConfig``: everything one gateway process is configured with (``python -m gateway`` fills it
from its command line; tests build it directly). Plain data: importing it loads no HTTP framework."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

from core.redisconn import DEFAULT_TIMEOUT_S
from gateway.complexity import ComplexityConfig
from gateway.openai_api import Limits


@dataclass(slots=True)
class GatewayConfig:
    model: str = "default"                   # what --model names (see family/manifest.py)
    tiers: str | None = None                 # --tiers for a model that is not a nested checkpoint
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = field(default_factory=lambda: os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
                                             # or redis+sentinel://H1:P1,H2:P2/MASTER/DB (core.redisconn)
    redis_timeout_s: float = DEFAULT_TIMEOUT_S  # a silent Redis peer is dropped after this long
    gateway_id: str = field(default_factory=lambda: f"gw-{uuid.uuid4().hex[:8]}")
    max_inflight: int = 256                  # requests in flight before this gateway answers 429
    max_body_bytes: int = 4 << 20            # larger bodies get 413
    request_timeout_s: float = 600.0         # the gateway's own deadline per request (then Cancel, 504)
    stall_timeout_s: float = 15.0            # after a Redis outage/restart: a request with no event this
                                             # long after Redis is back fails (503, retryable; Cancel)
    default_max_tokens: int | None = None    # chat without max_tokens: the rest of the context, capped here
    api_keys: list[str] = field(default_factory=list)  # none and no file: the gateway is open
    api_keys_file: str | None = None         # one key per line, '#' comments; re-read when it changes
    rpm: int = 0                             # requests per minute per key (0: unlimited)
    tpm: int = 0                             # tokens (prompt + max_tokens) per minute per key (0: unlimited)
    max_prompt_tokens: int = 0               # 0: only the context bounds the prompt
    limits: Limits = field(default_factory=Limits)  # bounds on one request body
    complexity: ComplexityConfig = field(default_factory=ComplexityConfig)
    # Multi-level sampling defaults (a request's "mfs" body field overrides them; see README)
    spec_draft_tier: str | int | None = None  # self-speculation draft tier (name, model id, index); None: off
    spec_gamma: int = 4                      # draft tokens per verification round (1..16)
    cascade_threshold: float | None = None   # confidence cascade for family-id requests (0 < P < 1); None: off
    cascade_window: int = 4                  # tokens the cascade's confidence is averaged over (1..64)
    reader_block_ms: int = 1000
    frontend: object | None = None           # a loaded family.manifest.Frontend (tests share one)

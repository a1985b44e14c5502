"""What the gateway's OpenAPI document depends on (:class:`Facts`), read from its Service and config."""
from __future__ import annotations

from gateway.openai_api import Limits


class Facts:
    """What the document depends on, read from the gateway's Service and config."""

    def __init__(self, svc, cfg):
        self.tier_ids: list[str] = list(svc.tier_ids)
        self.tier_names: list[str] = list(svc.tier_names)
        self.family: str = svc.frontend.family_id
        self.vocab: int = int(svc.vocab_size)
        self.default_draft: int | None = svc.spec_draft_tier
        self.default_gamma: int = svc.spec_gamma
        self.default_threshold: float | None = svc.cascade_threshold
        self.default_window: int = svc.cascade_window
        self.max_prompt_tokens: int = svc.max_prompt_tokens
        self.default_max_tokens: int | None = svc.default_max_tokens
        self.limits: Limits = cfg.limits
        self.max_body_bytes: int = cfg.max_body_bytes
        self.request_timeout_s: float = cfg.request_timeout_s
        self.max_inflight: int = cfg.max_inflight

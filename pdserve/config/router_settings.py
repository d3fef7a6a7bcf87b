"""The ``router`` section of the cluster file: the router's HTTP API, policy, timeouts and streams.

Cross-field checks that involve only router settings (flush intervals against the inter-token
timeout, the prefill deadline against the request deadline) are made here, at load.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdserve.config.frozen import _Frozen
from pdserve.errors import ConfigError


class RouterConfig(_Frozen):
    REMOVED_KEYS = {
        "decode_stream": (
            "the router always carries decode legs on each decode node's Steps socket (one stream "
            "per node, each step's tokens of all its legs in one frame)"
        ),
    }
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)  # OpenAI HTTP API and /metrics
    api_key: str | None = None  # clients send "Authorization: Bearer <api_key>" when set
    # cache_aware: by the KV each node holds (KV events through redis_url, which it needs) against
    # its load; costs in prefilled blocks (services/router/cache_aware.py):
    #   prefill (prompt blocks - held) x block_cost + load x load_cost + kv usage x kv_usage_cost
    #   decode  load x load_cost + kv usage x kv_usage_cost - held x block_cost
    policy: Literal["least_loaded", "prefix_affinity", "round_robin", "cache_aware"] = "least_loaded"
    cache_aware_block_cost: float = Field(default=1.0, gt=0)
    cache_aware_load_cost: float = Field(default=8.0, ge=0)
    cache_aware_kv_usage_cost: float = Field(default=16.0, ge=0)
    # A prompt block a node holds only in its offload tier (cpu / disk: KV events' tier) counts as
    # this fraction of a block held on the device (it is copied in, not prefilled); 0 ignores them.
    cache_aware_offload_hit_weight: float = Field(default=0.5, ge=0, le=1)
    # The router's prefix index keeps at most this many block hashes per node (oldest dropped).
    prefix_index_max_blocks_per_node: int = Field(default=1 << 20, ge=1)
    # Conditional disaggregation: prompts shorter than this prefill on the decode node, where a
    # KV transfer would cost more than the prefill itself. 0 disaggregates every prompt.
    local_prefill_max_tokens: int = Field(default=32, ge=0)
    request_timeout_s: float = Field(default=600.0, gt=0)  # whole request, first byte to last token
    # The prefill leg's deadline: P.Prefill call -> first token with the KV held (P's queue +
    # the prompt's prefill). Past it the router aborts the leg (P frees the KV at once) and tries
    # the next prefill node, then prefills on the decode node. Catches a wedged prefill engine
    # that still answers gRPC keepalive pings (a frozen process is noticed sooner, by keepalive).
    prefill_timeout_s: float = Field(default=30.0, gt=0)
    # Request lifecycle under failure. Bounded input: past these a request is a 400/413.
    max_body_bytes: int | None = Field(default=None, ge=1024)  # None: max(16 MiB, room for prompt_embeds)
    max_prompts_per_request: int = Field(default=256, ge=1)  # entries of a completions batch
    max_sequences_per_request: int = Field(default=256, ge=1)  # prompts x n
    # A response_format / structured_outputs constraint (JSON schema text, regex, grammar) longer
    # than this is a 400 naming it, before anything parses it (nodes: max_grammar_bytes)
    max_grammar_bytes: int = Field(default=65536, ge=1)
    # Characters of one prompt (a completions entry; a chat's message text, and its rendered
    # template), refused with a 400 before tokenizing. None: max_model_len x 32.
    max_prompt_chars: int | None = Field(default=None, ge=1)
    # Threads that tokenize, render chat templates and detokenize bodies over 2,048 characters,
    # off the event loop; tokenize_timeout_s bounds one body's wait and work there (then a 503).
    tokenizer_threads: int = Field(default=4, ge=1, le=64)
    tokenize_timeout_s: float = Field(default=60.0, gt=0)
    # Per-leg deadlines: a frozen (SIGSTOPped) or dead peer is noticed by these, not by the lease.
    decode_first_token_timeout_s: float = Field(
        default=30.0, gt=0
    )  # D.Decode call -> first delta (incl. pull)
    inter_token_timeout_s: float = Field(default=15.0, gt=0)  # gap between two deltas of a stream
    # Circuit breaker per node: this many consecutive node faults take it out of rotation for
    # breaker_open_s; then one probe request (half-open) decides. 4xx / 429 are not node faults.
    breaker_failures: int = Field(default=3, ge=1)
    breaker_open_s: float = Field(default=5.0, gt=0)
    http_keepalive_s: float = Field(default=75.0, ge=1)  # idle HTTP keep-alive connections close after this
    # Parses chat output under tool_choice auto into tool_calls (services/router/tool_parsers);
    # a name the router does not know is refused when the router starts, naming the known ones.
    tool_call_parser: str = "hermes"
    # Who makes the text of a sequence without stop strings: "router" (the nodes send token ids
    # only, so their engine threads skip it) or "node". Stop strings are always matched on the
    # node, which makes their text.
    detokenize: Literal["router", "node"] = "router"
    encode_timeout_s: float = Field(default=60.0, gt=0)  # router -> encoder Encode call
    # Non-streaming requests (decode legs travel on one Steps stream per decode node, batched
    # deltas of every leg, services/router/step_mux.py): the node holds their tokens and sends them
    # at most every this many ms (and at their end) instead of with every step; 0 = every step.
    # Must stay well under inter_token_timeout_s, which also bounds the gap between their messages.
    nonstream_flush_ms: int = Field(default=100, ge=0, le=60_000)
    # Streaming requests, likewise (vLLM's stream_interval, in time):
    # the first token at once, then a stream's tokens merged into one message and one SSE event
    # at most every this many ms, and the finish at once; 0 = every engine step. A stream whose
    # tokens come slower than this (most GPU serving) is not touched; a faster one (a small model,
    # a CPU host) gets them in groups, at 100 events/s at most by default, and its node, router
    # and client spend that much less per token (docs/benchmarks.md, "Streamed tokens grouped").
    stream_flush_ms: int = Field(default=10, ge=0, le=60_000)
    # When a P/D request's decode leg opens: with_prefill = together with the
    # prefill leg, so decode allocates and asks for the KV while the prompt is prefilled and the
    # pull brings the first token; after_prefill = once the first token is back (one leg, then
    # the other). A failed early pull is re-driven by the router as a failed pull is under
    # kv_load_failure_policy reprefill.
    pd_decode_leg: Literal["with_prefill", "after_prefill"] = "with_prefill"
    # Router worker processes sharing the HTTP port: each runs its own event loop,
    # node connections and registry view; /metrics adds them up. 1 = the router is one process.
    workers: int = Field(default=1, ge=1, le=64)

    @model_validator(mode="after")
    def _check_timeouts(self) -> RouterConfig:
        for name in ("nonstream_flush_ms", "stream_flush_ms"):
            ms = getattr(self, name)
            if ms / 1000.0 > self.inter_token_timeout_s / 2:
                raise ConfigError(
                    f"router.{name} ({ms}) is over half of router.inter_token_timeout_s "
                    f"({self.inter_token_timeout_s} s): a held request would look like a stalled node; "
                    "lower it"
                )
        if self.prefill_timeout_s > self.request_timeout_s:
            raise ConfigError(
                f"router.prefill_timeout_s ({self.prefill_timeout_s}) exceeds router.request_timeout_s "
                f"({self.request_timeout_s}); the prefill leg is part of the request, lower it"
            )
        return self

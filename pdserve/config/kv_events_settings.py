"""The ``kv_events`` section of the cluster file: how nodes publish KV events to ``redis_url`` and
how the router follows them (pdserve/kvevents/; used by ``router.policy: cache_aware``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from pdserve.config.frozen import _Frozen
from pdserve.errors import ConfigError


class KVEventsSettings(_Frozen):
    # Node side (pdserve/kvevents/publisher.py).
    flush_interval_s: float = Field(default=0.02, gt=0, le=10)  # gathered events go out this often
    max_pending_events: int = Field(default=65536, ge=1)  # waiting to be sent; more are dropped (a gap)
    max_events_per_entry: int = Field(default=4096, ge=1)  # a longer batch is split into stream entries
    stream_maxlen: int = Field(default=10000, ge=1)  # stream entries Redis keeps per node (approximate)
    redis_timeout_s: float = Field(default=1.0, gt=0, le=60)  # one Redis operation, both sides
    # Router side (pdserve/kvevents/consumer.py).
    resync_timeout_s: float = Field(default=2.0, gt=0, le=600)  # a snapshot not seen by then is asked again
    read_block_ms: int = Field(default=200, ge=1, le=10_000)  # one XREAD waits this long for entries
    retry_s: float = Field(default=1.0, gt=0, le=60)  # after a failed read (Redis unreachable)

    @model_validator(mode="after")
    def _check_resync(self) -> KVEventsSettings:
        if self.resync_timeout_s <= self.flush_interval_s:
            raise ConfigError(
                f"kv_events.resync_timeout_s ({self.resync_timeout_s}) must exceed "
                f"kv_events.flush_interval_s ({self.flush_interval_s}): a node sends the snapshot "
                "with its next flush, so a shorter wait asks again before it can come; raise it"
            )
        return self

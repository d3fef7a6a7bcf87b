"""``kv_load_failure_policy`` (docs/design.md §2): what decode does when a KV pull fails.

    fail       the request ends with an error (the client gets a clean error)
    recompute  decode prefills the prompt itself (no transfer)
    reprefill  decode ends its leg with the status below; the router asks another prefill node
               for the KV and sends decode the request again (the first token the client already
               has goes along as an output token, so nothing is sent twice)

The engine knows only fail and recompute; reprefill is fail on the engine plus the marker.
The policy is a :class:`~pdserve.config.choices.KvLoadFailurePolicy`, checked at load.
"""

from __future__ import annotations

from pdserve.config.choices import KvLoadFailurePolicy

# Trailing metadata key on decode's ABORTED status: the KV pull failed and may be re-prefilled.
KV_LOAD_FAILED_KEY = "pdserve-kv-load-failed"


def engine_policy(policy: KvLoadFailurePolicy) -> KvLoadFailurePolicy:
    """The policy the engine applies: reprefill fails the request there (the router retries)."""
    return KvLoadFailurePolicy.FAIL if policy is KvLoadFailurePolicy.REPREFILL else policy

"""The real redis-server fixture of tests/registry, for the KV event tests."""

from __future__ import annotations

from tests.registry.conftest import redis_proc  # noqa: F401 (the fixture)

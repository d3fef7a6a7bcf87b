"""Fixtures of the end-to-end tests: a real redis-server (tests/registry) for the fleet tests."""

from __future__ import annotations

from tests.registry.conftest import redis_proc  # noqa: F401 (the fixture)

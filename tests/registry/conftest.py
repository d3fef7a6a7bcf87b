from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.registry.redis_proc import RedisProcess


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    r = RedisProcess().start()
    try:
        yield r
    finally:
        r.stop()

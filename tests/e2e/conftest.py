"""Fixtures of the end-to-end tests: a real redis-server (tests/registry) for the fleet tests, and
one router + prefill + decode cluster shared by several modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cluster import RunningCluster, revive, running_cluster
from tests.e2e.lifecycle_helpers import isolated_cluster_config
from tests.registry.conftest import redis_proc  # noqa: F401 (the fixture)


@pytest.fixture(scope="session")
def _shared_pd_cluster(tiny_models, tmp_path_factory) -> Iterator[RunningCluster]:
    # The lease is long (60 s): every release the lifecycle tests assert comes from an abort.
    cfg = isolated_cluster_config(
        tiny_models["llama"], router={"local_prefill_max_tokens": 16}, all={"kv_lease_s": 60.0}
    )
    with running_cluster(cfg, tmp_path_factory.mktemp("shared-pd")) as rc:
        yield rc


@pytest.fixture(scope="module")
def shared_pd_cluster(_shared_pd_cluster: RunningCluster) -> RunningCluster:
    """router + prefill-0 + decode-0 on the tiny llama (router.local_prefill_max_tokens 16, KV
    lease 60 s), started once for the modules that use it (test_lifecycle_e2e,
    test_request_state_e2e, test_router_e2e: ~12 s of start-up each on 2 cores). A node a module
    killed is started again at the next module's start. Each test leaves nothing held."""
    revive(_shared_pd_cluster)
    return _shared_pd_cluster

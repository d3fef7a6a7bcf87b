"""The start-up heap of a node or router process, kept out of Python's full collections.

Once started, a node or a router holds ~340,000 objects the garbage collector tracks (torch,
transformers, gRPC, protobuf, its own modules), nearly all of them alive until it exits.
CPython collects its oldest generation when the objects promoted into it since the last full
collection exceed a quarter of those in it, and a full collection walks every tracked object
with the GIL held: no thread of the process runs Python meanwhile. Whether start-up itself
crosses that threshold once more is a matter of a few thousand objects; where it does not, the
first traffic sets the collection off: 150-470 ms on the 2-core CPU host (longer when its cores
are busy) in the prefill node and in the decode node, which stalled every stream once
(bench/served.py --variants pd --concurrency 16 --modes stream: inter-token p99 36-75 ms and
TTFT p99 up to 460 ms in the first measured window, 15-40 ms and 125-320 ms in the others).

``freeze_startup_heap`` collects once, then moves every surviving object to the permanent
generation (``gc.freeze``): later collections skip them, so a full collection walks only what
was allocated after start-up, and the next one is due only when a quarter of the frozen count
has been promoted since (in bench/served.py runs none came while serving; the one at exit walked
200-1,800 objects in about 1 ms). The freeze's own collection costs start-up one full
collection (0.4-0.7 s here), which the process would otherwise pay while serving.
Objects frozen here are never collected: the start-up heap holds modules, weights and
long-lived services that live as long as the process anyway.

Only processes call it (``services.launch.run_node``, ``services.router.server.serve_router``,
``services.encoder.server.run_encoder``);
nodes that tests start in their own process leave the test process's collector alone.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect garbage, then freeze every tracked object left (``gc.freeze``); returns how many
    objects the permanent generation holds. ``what``: the process, for the log line."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        what,
        frozen,
        1e3 * (time.perf_counter() - t0),
    )
    return frozen

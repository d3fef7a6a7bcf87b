"""Schemathesis against the router's own OpenAPI schema: no 5xx, no crash.

    PYTHONPATH=$PWD .venv/bin/python bench/fuzz.py [--cases 2000] [--target fake|cluster]
                                                   [--valid-share 0.2] [--out bench/results/fuzz.json]

``fake`` (default): the router app in-process (ASGI) with a fake backend, as the bounded CI run
(tests/services/test_router_schemathesis.py) but with ``--cases`` cases spread over every
operation: the HTTP layer alone (validation, error shapes, structured outputs, tokenize).
``cluster``: the real router, prefill and decode processes (tiny model) over HTTP; generated
``max_tokens`` / ``max_completion_tokens`` are capped at 8 (a chat body with neither gets
``max_tokens`` 8) and ``n`` at 2 so a valid case costs milliseconds, not a long generation.
Afterwards every node must still be SERVING, hold no KV block, and the router must answer a
plain request.

In both, nine bodies in ten get the served model's name in ``model`` (random names stop at the
404 of an unknown model). Schema-driven bodies are nearly all refused (a random ``prompt`` or
``messages`` is rarely a servable one), so ``--valid-share`` of the cases (default 0.2) come from
hand-written strategies of valid completions and chat bodies (text / token-id / batch prompts,
Unicode text without lone surrogates, stop strings, seeds, logprobs, echo, n, streaming): those
must answer 200 (a stream: no error event), and reach the backend's generation path.
A case fails on a 5xx, a connection error or a timeout (30 s), or a valid body answered other
than 200. Prints a table of status codes per operation; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2}
# The fake target's context: the tiny model's 2,048 positions, as on the cluster (a valid chat of
# five random-Unicode texts reached 149 tokens, over the 128 the router tests use).
FAKE_MAX_MODEL_LEN = 2048
VALID_OPS = ("valid POST /v1/completions", "valid POST /v1/chat/completions")


_n = [0]


def _prepare(body: Any, model: str, cap: bool) -> None:
    """Nine cases in ten name the served model (else nearly every case stops at the 404 of an
    unknown model); ``cap``: keep generation short on a real cluster."""
    if not isinstance(body, dict):
        return
    _n[0] += 1
    if "model" in body and _n[0] % 10:
        body["model"] = model
    if cap:
        if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = CAPS["max_tokens"]  # else chat generates to the end of the context
        for k, limit in CAPS.items():
            v = body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > limit:
                body[k] = limit


def _valid_strategies(model: str) -> dict[str, Any]:
    """Hypothesis strategies of servable bodies: short prompts, token ids under 100 (inside any
    test vocabulary), max_tokens <= 8, text of any Unicode but lone surrogates."""
    from hypothesis import strategies as st

    text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=40)
    ids = st.lists(st.integers(1, 99), min_size=1, max_size=24)
    common: dict[str, Any] = {
        "temperature": st.sampled_from([0.0, 0.5, 1.0]),
        "top_p": st.floats(0.1, 1.0),
        "top_k": st.sampled_from([-1, 1, 5]),
        "seed": st.integers(0, 2**31),
        "n": st.integers(1, 2),
        "stop": st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=4), max_size=3),
        "stream": st.booleans(),
        "min_tokens": st.integers(0, 1),
        "presence_penalty": st.floats(-1.0, 1.0),
    }

    def body(required: dict[str, Any], extra: dict[str, Any]) -> Any:
        # max_tokens always: a chat without it generates up to the end of the context
        fixed = {"model": st.just(model), "max_tokens": st.integers(1, 8), **required}
        return st.fixed_dictionaries(fixed, optional={**common, **extra}).map(_with_usage)

    prompt = st.one_of(
        text, ids, st.lists(text, min_size=1, max_size=3), st.lists(ids, min_size=1, max_size=3)
    )
    part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
    content = st.one_of(text, st.lists(part, min_size=1, max_size=2))
    turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": content})
    system = st.fixed_dictionaries({"role": st.just("system"), "content": text})
    messages = st.tuples(st.lists(system, max_size=1), st.lists(turn, max_size=2), content).map(
        lambda t: [*t[0], *t[1], {"role": "user", "content": t[2]}]
    )
    return {
        VALID_OPS[0]: body({"prompt": prompt}, {"logprobs": st.integers(0, 3), "echo": st.booleans()}),
        VALID_OPS[1]: body(
            {"messages": messages},
            {"logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 8)},
        ),
    }


def _with_usage(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return body


def run_valid(model: str, cases: int, post: Any, statuses: Any, failures: list[Any]) -> None:
    """``cases`` valid bodies split over completions and chat; each must answer 200."""
    for op, strategy in _valid_strategies(model).items():
        _run_valid_op(op, strategy, math.ceil(cases / 2), post, statuses, failures)


def _run_valid_op(op: str, strategy: Any, n: int, post: Any, statuses: Any, failures: list[Any]) -> None:
    from hypothesis import HealthCheck, given, settings

    path = op.split(" ", 2)[2]

    @given(body=strategy)
    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(body: dict[str, Any]) -> None:
        try:
            status, text = post(path, body)
        except Exception as e:  # connection refused / reset / timeout: the server broke
            failures.append({"op": op, "error": repr(e)[:300], "body": repr(body)[:300]})
            statuses[op][-1] += 1
            return
        statuses[op][status] += 1
        error_event = body.get("stream") and 'data: {"error"' in text
        if status != 200 or error_event:
            failures.append({"op": op, "status": status, "body": repr(body)[:300], "text": text[:300]})

    check()


def run(schema: Any, cases: int, call: Any, valid: tuple[str, int, Any] | None = None) -> dict[str, Any]:
    """Schema cases until ``cases`` in all, after ``valid`` = (model, how many, post) valid bodies."""
    ops = [r.ok() for r in schema.get_all_operations()]
    statuses: dict[str, Counter[int]] = defaultdict(Counter)
    failures: list[dict[str, Any]] = []
    if valid is not None:
        run_valid(valid[0], valid[1], valid[2], statuses, failures)
    # Operations without a body or parameters run out of distinct examples early: repeat rounds
    # (fresh random examples each) until the total reaches ``cases``.
    for _round in range(8):
        done = sum(sum(c.values()) for c in statuses.values())
        if done >= cases:
            break
        per_op = max(1, math.ceil((cases - done) / len(ops)))
        for op in ops:
            _run_op(op, per_op, call, statuses, failures)
    return {
        "operations": len(ops),
        "cases": sum(sum(c.values()) for c in statuses.values()),
        "statuses": {k: dict(v) for k, v in statuses.items()},
        "valid_200": sum(statuses[op][200] for op in VALID_OPS),
        "server_errors": sum(n for c in statuses.values() for code, n in c.items() if code >= 500),
        "failures": failures,
    }


def _run_op(
    op: Any, per_op: int, call: Any, statuses: dict[str, Counter[int]], failures: list[dict[str, Any]]
) -> None:
    from hypothesis import HealthCheck, given, settings

    key = f"{op.method.upper()} {op.path}"

    @given(case=op.as_strategy())
    @settings(max_examples=per_op, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case: Any) -> None:
        try:
            r = call(case)
        except Exception as e:  # connection refused / reset / timeout: the server broke
            failures.append({"op": key, "error": repr(e)[:300], "body": repr(case.body)[:300]})
            statuses[key][-1] += 1
            return
        statuses[key][r.status_code] += 1
        if r.status_code >= 500:
            failures.append(
                {"op": key, "status": r.status_code, "body": repr(case.body)[:300], "text": r.text[:300]}
            )

    check()


def fake_target(cases: int, num_valid: int) -> dict[str, Any]:
    import schemathesis
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from pdserve.models.make_model import make_tiny_model
    from services.router.app import create_app
    from tests.services.test_router_api import HIDDEN, MODEL, FakeBackend

    model = make_tiny_model("qwen3", Path(tempfile.mkdtemp(prefix="pdserve-fuzz-")) / "model")
    backend = FakeBackend()
    app = create_app(
        backend, AutoTokenizer.from_pretrained(model), [MODEL], FAKE_MAX_MODEL_LEN, hidden_size=HIDDEN
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    client = TestClient(app)

    def call(case: Any) -> Any:
        _prepare(case.body, MODEL, cap=False)
        return case.call()

    def post(path: str, body: Any) -> tuple[int, str]:
        r = client.post(path, json=body)
        return r.status_code, r.text

    out = run(schema, cases, call, (MODEL, num_valid, post))
    # The fake backend's sequences: every one the router started finished or was cancelled.
    out["after"] = {"backend_sequences": len(backend.requests), "cancelled": len(backend.cancelled)}
    return out


def cluster_target(cases: int, num_valid: int) -> dict[str, Any]:
    import httpx
    import schemathesis

    from pdserve.models.make_model import make_tiny_model
    from tests.e2e.cluster import running_cluster
    from tests.e2e.lifecycle_helpers import (
        health_status,
        held_state,
        isolated_cluster_config,
        wait_nothing_held,
    )

    root = Path(tempfile.mkdtemp(prefix="pdserve-fuzz-"))
    model = make_tiny_model("llama", root / "model")
    cfg = isolated_cluster_config(model, router={"local_prefill_max_tokens": 16})
    with running_cluster(cfg, root / "run") as rc:
        url = rc.cluster.router_url
        schema = schemathesis.openapi.from_url(url + "/openapi.json")

        def call(case: Any) -> Any:
            _prepare(case.body, rc.model_name, cap=True)
            return case.call(base_url=url, timeout=30)

        with httpx.Client(base_url=url, timeout=30) as client:

            def post(path: str, body: Any) -> tuple[int, str]:
                r = client.post(path, json=body)
                return r.status_code, r.text

            out = run(schema, cases, call, (rc.model_name, num_valid, post))
        after: dict[str, Any] = {n: health_status(rc.node(n).grpc_address) for n in ("prefill-0", "decode-0")}
        # (blocks used, held requests, blocks held for transfer, stranded blocks) per node
        after["held_state"] = held_state(rc, ["prefill-0", "decode-0"])
        try:
            wait_nothing_held(rc, ["prefill-0", "decode-0"], timeout_s=30)
            after["blocks_held"] = 0
        except AssertionError as e:
            after["blocks_held"] = str(e)
        r = httpx.post(
            url + "/v1/completions",
            json={"model": rc.model_name, "prompt": "after the fuzz", "max_tokens": 4},
            timeout=30,
        )
        after["plain_request"] = r.status_code
        out["after"] = after
        if any(v != "SERVING" for k, v in after.items() if k.endswith("-0")) or after["blocks_held"] != 0:
            out["failures"].append({"after": after})
        if r.status_code != 200:
            out["failures"].append({"after": after})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=2000, help="at least this many cases in all")
    ap.add_argument("--target", choices=("fake", "cluster"), default="fake")
    ap.add_argument("--valid-share", type=float, default=0.2, help="share of cases that are valid bodies")
    ap.add_argument("--out", type=Path, default=Path("bench/results/fuzz.json"))
    args = ap.parse_args()
    t0 = time.monotonic()
    num_valid = round(args.cases * args.valid_share)
    target = fake_target if args.target == "fake" else cluster_target
    out = target(args.cases, num_valid)
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["target"] = args.target
    print("| operation | cases | status codes |\n|---|---:|---|")
    for op, st in sorted(out["statuses"].items()):
        codes = ", ".join(f"{c}: {n}" for c, n in sorted(st.items()))
        print(f"| {op} | {sum(st.values())} | {codes} |")
    print(
        f"\n{out['cases']} cases over {out['operations']} operations in {out['seconds']} s "
        f"({args.target}); valid generation requests answered 200: {out['valid_200']}; "
        f"5xx: {out['server_errors']}; failures: {len(out['failures'])}; after: {out.get('after')}"
    )
    for f in out["failures"][:10]:
        print("  ", f)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    raise SystemExit(1 if out["failures"] or out["cases"] < args.cases else 0)


if __name__ == "__main__":
    main()

"""Chaos matrix of the request lifecycle: scenario x target x phase -> outcome.

    PYTHONPATH=$PWD .venv/bin/python bench/chaos.py [--quick] [--out bench/results/chaos.json]
                                                    [--markdown docs/reliability.md]

Real node processes on loopback: prefill-0, prefill-1, decode-0 (``kv_load_failure_policy
reprefill``, ``kv_keepalive_s`` 0.5), every node ``kv_lease_s`` 3 and the test-only fault settings
``faults.push_delay_s`` 1 (prefill: every PushKV waits 1 s before its KV write, so a fault can
land during the transfer) and ``faults.engine_death_on_sigusr1``. Router deadlines: prefill 10 s,
decode first token 10 s, between tokens 2 s; breaker 1 failure, open 2 s.

Two parts. "backend": the router's lifecycle in-process (``tests/e2e/faults.PhasedBackend`` is
``PDBackend`` plus a phase hook), so a fault lands at an exact phase. "http": the real router
process, clients with the official ``openai`` client (streaming completions); the phase is seen
from outside (the client's first chunk, a PushKV in flight on a prefill node, the 5th chunk).

Scenarios (the fault hits the node of the request's leg on ``target``):

    kill9          SIGKILL, then the node is restarted (fresh epoch)
    sigstop        SIGSTOP for 6 s (a frozen peer), then SIGCONT
    sigstop_long   SIGSTOP for 15 s, past every deadline (encoder part only), then SIGCONT
    restart        SIGKILL and an immediate restart (the node is back during the request)
    slow_peer      SIGSTOP for 1 s (below the deadlines: slower, must still succeed)
    engine_death   the node's engine thread dies (SIGUSR1, faults.engine_death_on_sigusr1): the
                   node turns NOT_SERVING, fails its requests, exits 70; then it is restarted
    disconnect     the client goes away (its task is cancelled / it closes the stream) at the phase
    drop_transfer  prefill's hold is dropped (Abort) at the phase: a lost transfer

Phases (backend): before_prefill, after_prefill (KV held, before decode admits), during_transfer
(a PushKV of the request is in flight on its prefill node), during_decode (after 3 deltas),
concurrent (4 clients at once, the fault fires at after_prefill of the first).
Phases (http): first_token (the client has prefill's token: the KV is held or being pulled),
during_transfer, during_decode (after 5 chunks), concurrent (4 clients, fault at the first
PushKV seen in flight).
Part "encoder" (``--part encoder``; also the last part of ``all``): its own cluster, a tiny LLaVA
with encoder-0 -> prefill-0 -> decode-0, a real redis-server (embedding-cache index), leases 3 s,
the encoder with ``faults.encode_delay_s`` 1 and ``faults.ec_push_delay_s`` 1 (a window for each
phase), router ``encode_timeout_s`` 10. Streaming chat requests with a fresh image_url each (a
cache miss), through the real router with the openai client, compared with transformers'
LlavaForConditionalGeneration. Scenarios kill9 / sigstop / sigstop_long / restart of the encoder; phases
before_admission (the fault before the request is sent), during_encode (the encoder serves the
Encode, nothing reserved on prefill yet), during_push (prefill holds an embedding reservation
the encoder is pushing into), after_embeddings (the client has its first token), concurrent (4
clients, fault at the first Encode seen). "blocks left" there also counts prefill's embedding
reservations (``num_ec_reservations``) and Redis index entries left after the lease; "serves
after" needs a text request and an image request served through the router.

Per cell: outcome (ok = every token, equal to the undisturbed greedy run; retried = ok through
reprefill / local fallback / another prefill; error = a clean error delta; cancelled = the client
left; hang = past the 40 s deadline), seconds to the end of the slowest request, then after the
node is repaired and a lease has passed: KV blocks used + held + stranded on every node, and
whether a new request is served.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import log
from pdserve.engine.sampling_params import SamplingParams
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.launcher import ports_free, start_child, wait_ready
from services.router.backend import BackendRequest
from tests.e2e.cluster import running_cluster
from tests.e2e.faults import backend_for, exit_code, freeze_for, kill_engine, signal_node
from tests.e2e.lifecycle_helpers import held_state, two_prefill_config

NODES = ["prefill-0", "prefill-1", "decode-0"]
LEASE_S = 3.0
REQUEST_DEADLINE_S = 40.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
PROMPT = [(11 * i) % 500 + 1 for i in range(120)]
SCENARIOS = ("kill9", "sigstop", "restart", "slow_peer", "engine_death", "disconnect", "drop_transfer")
PHASES = ("before_prefill", "after_prefill", "during_transfer", "during_decode", "concurrent")
HTTP_SCENARIOS = ("kill9", "sigstop", "engine_death", "disconnect")
HTTP_PHASES = ("first_token", "during_transfer", "during_decode", "concurrent")
PUSH_DELAY_S = 1.0
ROUTER = {
    "prefill_timeout_s": 10.0,
    "decode_first_token_timeout_s": 10.0,
    "inter_token_timeout_s": 2.0,
    "breaker_failures": 1,
    "breaker_open_s": 2.0,
}


@dataclass
class Cell:
    path: str  # backend | http
    scenario: str
    target: str
    phase: str
    outcome: str
    seconds: float
    blocks_left: int
    stranded: int
    serves_after: bool
    note: str = ""


def cells(
    quick: bool, scenarios: tuple[str, ...] = SCENARIOS, phases: tuple[str, ...] = PHASES
) -> list[tuple[str, str, str]]:
    out = []
    for sc in scenarios:
        targets = (
            ["client"]
            if sc == "disconnect"
            else ["prefill"]
            if sc == "drop_transfer"
            else ["prefill", "decode"]
        )
        for t in targets:
            for ph in phases:
                out.append((sc, t, ph))
    if quick:
        keep = {("kill9", "prefill", "after_prefill"), ("sigstop", "decode", "during_decode"),
                ("disconnect", "client", "after_prefill"), ("drop_transfer", "prefill", "after_prefill"),
                ("restart", "prefill", "before_prefill"), ("slow_peer", "decode", "during_decode"),
                ("kill9", "prefill", "during_transfer"), ("engine_death", "decode", "during_decode"),
                ("engine_death", "prefill", "first_token"), ("disconnect", "client", "during_transfer"),
                ("kill9", "decode", "during_transfer")}  # fmt: skip
        out = [c for c in out if c in keep]
    return out


class Chaos:
    def __init__(self, rc: Any) -> None:
        self.rc = rc
        self.restart_n = 0
        self.killed: set[str] = set()
        self.exit_codes: dict[str, int | None] = {}  # engine_death: the node's own exit code
        self.want: list[int] = []  # greedy tokens of PROMPT, undisturbed

    def restart(self, name: str, wait: bool = True) -> None:
        child = next(c for c in self.rc.children if c.name == name)
        if child.proc.poll() is None:
            signal_node(self.rc, name, signal.SIGKILL)
        self.rc.children.remove(child)
        n = self.rc.node(name)
        deadline = time.monotonic() + 10
        while not ports_free(n.host, [n.grpc_port, n.metrics_port]) and time.monotonic() < deadline:
            time.sleep(0.2)  # the killed process's sockets must be gone before the new one binds
        self.restart_n += 1
        d = self.rc.run_dir / f"restart-{self.restart_n}"
        d.mkdir(exist_ok=True)
        self.rc.children.append(start_child(self.rc.run_dir / "cluster.yaml", child.role, name, d))
        if wait:
            self.wait_all()

    def wait_all(self) -> None:
        wait_ready(self.rc.cluster, self.rc.children, timeout_s=120, router=True)

    async def fault(self, scenario: str, node: str) -> None:
        if scenario == "kill9":
            signal_node(self.rc, node, signal.SIGKILL)
            self.killed.add(node)
        elif scenario == "restart":
            self.restart(node, wait=False)
        elif scenario == "sigstop":
            await freeze_for(self.rc, node, 6.0)
        elif scenario == "sigstop_long":  # frozen past every deadline (encoder part)
            await freeze_for(self.rc, node, 15.0)
        elif scenario == "slow_peer":
            await freeze_for(self.rc, node, 1.0)
        elif scenario == "engine_death":
            kill_engine(self.rc, node)
            self.killed.add(node)
            self.exit_codes[node] = None

    async def repair(self) -> None:
        for t in list(self.rc.__dict__.get("_thaw_tasks", ())):
            await t
        self.rc.__dict__["_thaw_tasks"] = set()
        for name in list(self.exit_codes):
            if self.exit_codes[name] is None:  # the node exits by itself after its engine died
                self.exit_codes[name] = await asyncio.to_thread(exit_code, self.rc, name)
        for name in sorted(self.killed):
            await asyncio.to_thread(self.restart, name, False)
        self.killed.clear()
        await asyncio.to_thread(self.wait_all)


async def _drop(rc: Any, node: str, tid: str) -> None:
    import grpc

    async with grpc.aio.insecure_channel(rc.node(node).grpc_address) as ch:
        await pb_grpc.PrefillServiceStub(ch).Abort(pb.AbortRequest(transfer_ids=[tid]), timeout=5)


def _prefill_of(leg: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's info (node, transfer_id) from the phases a request has passed."""
    return leg.get("during_transfer") or leg.get("after_prefill") or leg.get("before_prefill") or {}


async def run_cell(chaos: Chaos, want: list[int], scenario: str, target: str, phase: str) -> Cell:
    rc = chaos.rc
    fired: list[str] = []
    legs: dict[str, dict[str, Any]] = {}
    tasks: dict[str, asyncio.Task[Any]] = {}
    first_id = "c0"

    async def hook(ph: str, info: dict[str, Any]) -> None:
        rid = info["request_id"]
        legs.setdefault(rid, {}).update({ph: info})
        want_phase = "after_prefill" if phase == "concurrent" else phase
        if fired or rid != first_id or ph != want_phase:
            return
        fired.append(ph)
        if scenario == "disconnect":
            tasks[rid].cancel()
            return
        src = _prefill_of(legs[rid])
        if scenario == "drop_transfer":
            if src.get("transfer_id") and src.get("node"):
                await _drop(rc, src["node"], src["transfer_id"])
            return
        await chaos.fault(scenario, "decode-0" if target == "decode" else src.get("node", "prefill-0"))

    b = backend_for(rc, hook=hook, request_timeout_s=REQUEST_DEADLINE_S, **ROUTER)
    b.start()
    await asyncio.sleep(0.6)  # first load poll: nodes healthy

    async def one(rid: str) -> tuple[str, list[int]]:
        toks: list[int] = []
        err = None
        async for d in b.generate(BackendRequest(rid, PROMPT, GREEDY)):
            toks += d.token_ids
            if d.finish_reason == "error":
                err = d.error
        return (f"error: {err}" if err else "ok"), toks

    n = 4 if phase == "concurrent" else 1
    t0 = time.monotonic()
    for i in range(n):
        tasks[f"c{i}"] = asyncio.ensure_future(one(f"c{i}"))
    done, _pending = await asyncio.wait(tasks.values(), timeout=REQUEST_DEADLINE_S)
    seconds = time.monotonic() - t0
    outcomes = []
    for _rid, t in tasks.items():
        if t not in done:
            t.cancel()
            outcomes.append("hang")
        elif t.cancelled():
            outcomes.append("cancelled")
        else:
            status, toks = t.result()
            outcomes.append(status if status != "ok" or toks == want else "wrong_tokens")
    retried = sum(
        b.path_total.labels(p)._value.get() for p in ("reprefill", "reprefill_local", "local_fallback")
    )
    retried += sum(s.value for m in b.leg_failures.collect() for s in m.samples if s.name.endswith("_total"))
    await b.close()
    left, stranded, serves_after, exits = await settle(chaos, want)
    outcome, note = summarize(outcomes, retried > 0, fired)
    return Cell(
        "backend", scenario, target, phase, outcome, round(seconds, 2), left, stranded, serves_after,
        _note(note, exits),
    )  # fmt: skip


def _note(note: str, exits: dict[str, int | None]) -> str:
    ex = ", ".join(f"{k} exited {v}" for k, v in exits.items())
    return "; ".join(x for x in (ex, note) if x)


def summarize(outcomes: list[str], retried: bool, fired: list[str]) -> tuple[str, str]:
    errors = [o for o in outcomes if o.startswith("error")]
    bad = [o for o in outcomes if o in ("hang", "wrong_tokens", "internal_error", "broken")]
    if bad:
        outcome = bad[0]
    elif errors:
        outcome = "error" if len(errors) == len(outcomes) else f"error {len(errors)}/{len(outcomes)}"
    elif "cancelled" in outcomes:
        outcome = "cancelled"
    else:
        outcome = "retried" if retried else "ok"
    if not fired:
        outcome += " (fault not fired)"
    note = errors[0][7:100] if errors else ""
    return outcome, note


async def settle(chaos: Chaos, want: list[int]) -> tuple[int, int, bool, dict[str, int | None]]:
    """Repair the cluster, wait a lease, read what is left; then: does a new request succeed?"""
    rc = chaos.rc
    await chaos.repair()
    exits, chaos.exit_codes = dict(chaos.exit_codes), {}
    await asyncio.sleep(LEASE_S + 1.5)
    state = held_state(rc, NODES)
    blocks_left = sum(s[0] + s[2] for s in state.values())
    stranded = sum(s[3] for s in state.values())
    # A new request on the repaired cluster (a fresh router view: breakers closed).
    probe = backend_for(rc, **ROUTER)
    serves_after = False
    for _ in range(3):  # a restarted node may take a poll to be seen
        st, toks = await one_with(probe, "probe")
        if st == "ok" and toks == want:
            serves_after = True
            break
        await asyncio.sleep(2)
    await probe.close()
    return blocks_left, stranded, serves_after, exits


async def one_with(b: Any, rid: str, prompt: list[int] = PROMPT) -> tuple[str, list[int]]:
    toks: list[int] = []
    err = None
    async for d in b.generate(BackendRequest(rid, prompt, GREEDY)):
        toks += d.token_ids
        if d.finish_reason == "error":
            err = d.error
    return ("error" if err else "ok"), toks


# -- the HTTP path: the real router process, the official openai client -------------------------
_prompt_n = [0]


def fresh_prompt() -> list[int]:
    """A prompt no earlier request used: the router sends prompts decode has seen to the local
    path, which would keep the prefill leg (and the fault) out of the request."""
    _prompt_n[0] += 1
    k = _prompt_n[0]
    return [(11 * i + 37 * k) % 500 + 1 for i in range(120)]


def router_retries(rc: Any) -> float:
    import httpx

    text = httpx.get(rc.cluster.router_url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("pdserve:router_leg_failures_total{") or any(
            line.startswith(f'pdserve:router_requests_by_path_total{{path="{p}"}}')
            for p in ("reprefill", "reprefill_local", "local_fallback")
        ):
            total += float(line.split()[-1])
    return total


async def _wait_transfer(rc: Any) -> str:
    """Until a prefill node serves a PushKV (the request's KV is being written into decode)."""
    while True:
        node = await _busy_prefill(rc, "push")
        if node is not None:
            return node
        await asyncio.sleep(0.02)


async def _busy_prefill(rc: Any, what: str) -> str | None:
    for name in ("prefill-0", "prefill-1"):
        try:
            r = await asyncio.to_thread(rc.load, name)
        except Exception:
            continue
        if (r.num_pushes_in_flight if what == "push" else r.num_blocks_held_for_transfer) > 0:
            return name
    return None


async def run_http_cell(chaos: Chaos, tok: Any, scenario: str, target: str, phase: str) -> Cell:
    import openai

    rc = chaos.rc
    n = 4 if phase == "concurrent" else 1
    prompts = [fresh_prompt() for _ in range(n)]
    ref = backend_for(rc, **ROUTER)
    wants = []
    for i, pr in enumerate(prompts):
        st, toks = await one_with(ref, f"ref-{i}", pr)
        assert st == "ok", "the undisturbed reference failed"
        # as the router detokenizes (skip_special_tokens, the default): a random model emits
        # special tokens now and then, which a plain decode() would spell out
        wants.append(tok.decode(toks, skip_special_tokens=True))
    await ref.close()
    retried0 = await asyncio.to_thread(router_retries, rc)
    client = openai.AsyncOpenAI(
        base_url=rc.base_url, api_key="unused", max_retries=0, timeout=REQUEST_DEADLINE_S
    )
    got = [{"chunks": 0} for _ in range(n)]
    streams: list[Any] = [None] * n

    fired: list[str] = []
    tasks: list[asyncio.Task[str]] = []

    async def fault(node: str | None) -> None:
        if fired:
            return
        fired.append(phase)
        if scenario == "disconnect":
            tasks[0].cancel()  # the client gives up: its HTTP connection is closed below
            if streams[0] is not None:
                await streams[0].close()
            return
        await chaos.fault(scenario, "decode-0" if target == "decode" else node or "prefill-0")

    async def one(i: int) -> str:
        text = ""
        try:
            stream = await client.completions.create(
                model=rc.model_name, prompt=prompts[i], max_tokens=GREEDY.max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            streams[i] = stream
            finish = None
            async for chunk in stream:
                got[i]["chunks"] += 1
                if chunk.choices:
                    text += chunk.choices[0].text or ""
                    finish = chunk.choices[0].finish_reason or finish
                # The client-side phases fire inline, while this client holds its stream.
                if i == 0 and phase == "first_token" and got[i]["chunks"] == 1:
                    await fault(await _busy_prefill(rc, "held"))
                if i == 0 and phase == "during_decode" and got[i]["chunks"] == 5:
                    await fault(None)
        except openai.APIStatusError as e:
            return f"error: {e.status_code} {e.message}"
        except openai.APIError as e:  # an error event in the stream (OpenAI's error body)
            if "internal error" in str(e.message):
                return "internal_error"
            return f"error: {e.message}"
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            return f"broken: {type(e).__name__}"
        if finish != "length":
            return f"error: finish_reason {finish}"
        if text == wants[i]:
            return "ok"
        k = next(
            (j for j, (a, b) in enumerate(zip(text, wants[i], strict=False)) if a != b),
            min(len(text), len(wants[i])),
        )
        return f"wrong_tokens: differs at char {k} of {len(wants[i])}: got {text[k : k + 30]!r}, want {wants[i][k : k + 30]!r}"

    t0 = time.monotonic()
    tasks += [asyncio.ensure_future(one(i)) for i in range(n)]

    async def trigger() -> None:
        if phase in ("during_transfer", "concurrent"):
            await fault(await _wait_transfer(rc))

    trig = asyncio.ensure_future(trigger())
    wrong: list[str] = []
    done, _ = await asyncio.wait(tasks, timeout=REQUEST_DEADLINE_S)
    seconds = time.monotonic() - t0
    trig.cancel()
    outcomes = []
    for t in tasks:
        if t not in done:
            t.cancel()
            outcomes.append("hang")
        elif t.cancelled():
            outcomes.append("cancelled")
        else:
            r = t.result()
            if r.startswith("wrong_tokens"):
                wrong.append(r)
                r = "wrong_tokens"
            outcomes.append("broken" if r.startswith("broken") else r)
    await client.close()
    retried = (await asyncio.to_thread(router_retries, rc)) > retried0
    left, stranded, serves_after, exits = await settle(chaos, chaos.want)
    outcome, note = summarize(outcomes, retried, fired)
    note = "; ".join([*wrong[:1], note]) if wrong else note
    return Cell(
        "http", scenario, target, phase, outcome, round(seconds, 2), left, stranded, serves_after,
        _note(note, exits),
    )  # fmt: skip


async def http_serves(rc: Any) -> bool:
    """The router process serves a new request (after a repair its view may lag a poll)."""
    import openai

    client = openai.AsyncOpenAI(base_url=rc.base_url, api_key="unused", max_retries=0, timeout=30)
    try:
        for _ in range(5):
            try:
                out = await client.completions.create(
                    model=rc.model_name, prompt=fresh_prompt(), max_tokens=4, temperature=0
                )
                if out.choices[0].finish_reason == "length":
                    return True
            except openai.APIError:
                pass
            await asyncio.sleep(2)
        return False
    finally:
        await client.close()


# -- the encoder part: image requests through the real router (encoder -> prefill -> decode) ----
ENC_NODES = ["prefill-0", "decode-0"]  # the nodes that hold KV / embedding reservations
ENC_SCENARIOS = ("kill9", "sigstop", "sigstop_long", "restart", "disconnect")
ENC_PHASES = ("before_admission", "during_encode", "during_push", "after_embeddings", "concurrent")
ENC_DELAY_S = 1.0  # faults.encode_delay_s and faults.ec_push_delay_s on the encoder
ENC_TOKENS = 24
ENC_TEXT = "What is in the picture?"
_image_n = [0]


def fresh_image() -> bytes:
    """An image no earlier request sent: the encoder's cache would skip the encoding otherwise."""
    from tests.e2e.epd_cluster import png

    _image_n[0] += 1
    return png(1000 + _image_n[0])


async def _encoder_phase(rc: Any, phase: str) -> None:
    """Until the image request reaches ``phase``: the encoder serves an Encode with no embedding
    reserved on prefill yet (during_encode), or prefill holds a reservation for an embedding the
    encoder is pushing (during_push)."""
    import grpc

    async with grpc.aio.insecure_channel(rc.node("encoder-0").grpc_address) as ch:
        stub = pb_grpc.EncoderServiceStub(ch)
        while True:
            try:
                p = await asyncio.to_thread(rc.load, "prefill-0")
                if phase == "during_push" and p.num_ec_reservations > 0:
                    return
                if phase == "during_encode" and p.num_ec_reservations == 0:
                    e = await stub.GetLoad(pb.LoadRequest(), timeout=1.0)
                    if e.num_in_flight > 0:
                        return
            except Exception:
                pass
            await asyncio.sleep(0.02)


def ec_state(rc: Any) -> tuple[int, int, int]:
    """(KV blocks used + held for transfer, stranded blocks, embedding reservations) on P and D."""
    blocks = stranded = ec = 0
    for name in ENC_NODES:
        r = rc.load(name)
        blocks += r.num_blocks_used + r.num_blocks_held_for_transfer
        stranded += r.stranded_kv_blocks
        ec += r.num_ec_reservations
    return blocks, stranded, ec


async def run_encoder_cell(chaos: Chaos, ref: Any, redis_url: str, scenario: str, phase: str) -> Cell:
    import openai

    from pdserve.embedcache.index import EmbeddingIndex
    from tests.e2e.epd_cluster import image_part

    rc = chaos.rc
    n = 4 if phase == "concurrent" else 1
    images = [fresh_image() for _ in range(n)]
    wants = [
        ref.tok.decode(ref.greedy(ENC_TEXT, [im], ENC_TOKENS), skip_special_tokens=True) for im in images
    ]
    client = openai.AsyncOpenAI(
        base_url=rc.base_url, api_key="unused", max_retries=0, timeout=REQUEST_DEADLINE_S
    )
    fired: list[str] = []
    held_at_end = ""
    tasks: list[asyncio.Task[str]] = []

    async def fault() -> None:
        if not fired:
            fired.append(phase)
            if scenario == "disconnect":  # the client goes away: its HTTP connection closes
                tasks[0].cancel()
                return
            await chaos.fault(scenario, "encoder-0")

    async def one(i: int) -> str:
        text, finish = "", None
        try:
            stream = await client.chat.completions.create(
                model=rc.model_name,
                messages=[{"role": "user", "content": [image_part(images[i]), {"type": "text", "text": ENC_TEXT}]}],
                max_tokens=ENC_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if i == 0 and phase == "after_embeddings" and text:
                    await fault()  # prefill's first token is out: the embeddings are consumed
        except openai.APIStatusError as e:
            return (
                "internal_error"
                if e.status_code >= 500 and e.status_code != 503
                else f"error: {e.status_code} {e.message}"
            )
        except openai.APIError as e:  # an error event in the stream
            return "internal_error" if "internal error" in str(e.message) else f"error: {e.message}"
        if finish != "length":
            return f"error: finish_reason {finish}"
        return "ok" if text == wants[i] else "wrong_tokens"

    t0 = time.monotonic()
    if phase == "before_admission":
        await fault()
    tasks += [asyncio.ensure_future(one(i)) for i in range(n)]

    async def trigger() -> None:
        if phase in ("during_encode", "during_push"):
            await _encoder_phase(rc, phase)
            await fault()
        elif phase == "concurrent":  # 4 clients; the fault once one of them is being encoded
            await _encoder_phase(rc, "during_encode")
            await fault()

    trig = asyncio.ensure_future(trigger())
    done, _ = await asyncio.wait(tasks, timeout=REQUEST_DEADLINE_S)
    seconds = time.monotonic() - t0
    trig.cancel()
    outcomes = []
    for t in tasks:
        if t not in done:
            t.cancel()
            outcomes.append("hang")
        elif t.cancelled():
            outcomes.append("cancelled")
        else:
            outcomes.append(t.result())
    await client.close()
    await asyncio.sleep(1.0)  # released at once (not by a lease)? read before the repair
    with contextlib.suppress(Exception):
        now = await asyncio.to_thread(ec_state, rc)
        if any(now):
            held_at_end = f"1 s after the end: blocks {now[0]}, stranded {now[1]}, ec reservations {now[2]}"
    # repair (thaw / restart the encoder), then a lease: nothing reserved, held, stranded, indexed
    await chaos.repair()
    await asyncio.sleep(LEASE_S + 1.5)
    blocks, stranded, ec = await asyncio.to_thread(ec_state, rc)
    keys = await asyncio.to_thread(lambda: EmbeddingIndex.from_url(redis_url).keys())
    text_ok = await http_serves(rc)
    image_ok = await enc_image_serves(rc, ref)
    outcome, note = summarize(outcomes, False, fired)
    extra = [held_at_end] if held_at_end else []
    extra += [f"ec reservations {ec}"] if ec else []
    extra += [f"{len(keys)} index entries left"] if keys else []
    extra += [] if image_ok else ["no image request served after"]
    return Cell(
        "encoder", scenario, "encoder", phase, outcome, round(seconds, 2), blocks + ec + len(keys), stranded,
        text_ok and image_ok, "; ".join([*extra, note] if note else extra),
    )  # fmt: skip


async def enc_image_serves(rc: Any, ref: Any) -> bool:
    """A new image request through the router gets the reference tokens (a poll may lag a restart)."""
    import openai

    from tests.e2e.epd_cluster import image_part

    img = fresh_image()
    want = ref.tok.decode(ref.greedy(ENC_TEXT, [img], 4), skip_special_tokens=True)
    client = openai.AsyncOpenAI(base_url=rc.base_url, api_key="unused", max_retries=0, timeout=30)
    try:
        for _ in range(5):
            try:
                out = await client.chat.completions.create(
                    model=rc.model_name,
                    messages=[{"role": "user", "content": [image_part(img), {"type": "text", "text": ENC_TEXT}]}],
                    max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
                )  # fmt: skip
                if out.choices[0].message.content == want:
                    return True
            except openai.APIError:
                pass
            await asyncio.sleep(2)
        return False
    finally:
        await client.close()


async def encoder_main(args: argparse.Namespace, root: Path) -> list[Cell]:
    from pdserve.models.make_model import make_tiny_model
    from tests.e2e.epd_cluster import LlavaReference, epd_config
    from tests.registry.redis_proc import RedisProcess

    model = make_tiny_model("llava", root / "llava")
    ref = LlavaReference(model)
    redis = RedisProcess().start()
    cfg = epd_config(
        model,
        redis.url,
        lease_s=LEASE_S,
        extra={
            "encoder-0": {"faults": {"encode_delay_s": ENC_DELAY_S, "ec_push_delay_s": ENC_DELAY_S}},
            "prefill-0": {"kv_lease_s": LEASE_S},
        },
        **{**ROUTER, "encode_timeout_s": 10.0, "request_timeout_s": REQUEST_DEADLINE_S},
    )
    todo = [(sc, ph) for sc in ENC_SCENARIOS for ph in ENC_PHASES]
    todo.remove(("disconnect", "before_admission"))  # no request to leave yet
    if args.quick:
        todo = [("kill9", "during_push"), ("sigstop_long", "during_push"), ("restart", "concurrent")]
    todo = [c for c in todo if not args.scenario or c[0] in args.scenario]
    results = []
    try:
        with running_cluster(cfg, root / "run-encoder", router=True) as rc:
            chaos = Chaos(rc)
            for sc, ph in todo:
                try:
                    cell = await run_encoder_cell(chaos, ref, redis.url, sc, ph)
                except Exception as e:
                    log(f"encoder {sc} {ph}: bench error {e!r}; restarting every node")
                    for name in ("encoder-0", *ENC_NODES):
                        await asyncio.to_thread(chaos.restart, name, False)
                    await asyncio.to_thread(chaos.wait_all)
                    cell = Cell("encoder", sc, "encoder", ph, "bench_error", 0.0, -1, -1, False, repr(e)[:80])
                log(f"encoder {sc:8s} {ph:17s} -> {cell.outcome:12s} {cell.seconds:6.2f} s  left "
                    f"{cell.blocks_left} stranded {cell.stranded} serves_after {cell.serves_after} {cell.note[:80]}")  # fmt: skip
                results.append(cell)
    finally:
        redis.stop()
    return results


def markdown(results: list[Cell], took_s: float) -> str:
    lines = [
        "| path | scenario | target | phase | outcome | s to end | blocks left | stranded | serves after |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for c in results:
        lines.append(
            f"| {c.path} | {c.scenario} | {c.target} | {c.phase} | {c.outcome} | {c.seconds:.2f} | "
            f"{c.blocks_left} | {c.stranded} | {'yes' if c.serves_after else 'NO'} |"
        )
    notes = [f"- {c.path}/{c.scenario}/{c.target}/{c.phase}: {c.note}" for c in results if c.note]
    return "\n".join(
        [
            *lines,
            "",
            f"{len(results)} cells in {took_s:.0f} s.",
            "",
            "Notes (exit codes, error messages):",
            *notes,
        ]
    )


async def main_async(args: argparse.Namespace) -> list[Cell]:
    from pdserve.models.loader import load_tokenizer
    from pdserve.models.make_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    if args.part == "encoder":
        return await encoder_main(args, root)
    model = make_tiny_model("llama", root / "model")
    faults = {"push_delay_s": PUSH_DELAY_S, "engine_death_on_sigusr1": True}
    cfg = two_prefill_config(
        model,
        router={**ROUTER, "local_prefill_max_tokens": 0, "request_timeout_s": REQUEST_DEADLINE_S},
        all={"kv_lease_s": LEASE_S},
        **{
            "prefill-0": {"faults": faults},
            "prefill-1": {"faults": faults},
            "decode-0": {
                "kv_load_failure_policy": "reprefill",
                "kv_keepalive_s": 0.5,
                "faults": {"engine_death_on_sigusr1": True},
            },
        },
    )
    tok = load_tokenizer(model)
    results = []
    with running_cluster(cfg, root / "run", router=True) as rc:
        chaos = Chaos(rc)
        st, want = await one_with(backend_for(rc, **ROUTER), "reference")
        assert st == "ok" and len(want) == GREEDY.max_tokens
        chaos.want = want
        todo = [("backend", c) for c in cells(args.quick)] if args.part in ("all", "backend") else []
        if args.part in ("all", "http"):
            todo += [("http", c) for c in cells(args.quick, HTTP_SCENARIOS, HTTP_PHASES)]
        todo = [c for c in todo if not args.scenario or c[1][0] in args.scenario]
        for path, (sc, t, ph) in todo:
            try:
                if path == "backend":
                    cell = await run_cell(chaos, want, sc, t, ph)
                else:
                    cell = await run_http_cell(chaos, tok, sc, t, ph)
                    if cell.serves_after:
                        cell.serves_after = await http_serves(rc)
            except Exception as e:  # a broken cell (e.g. a port taken meanwhile) must not end the matrix
                log(f"{path} {sc} {t} {ph}: bench error {e!r}; restarting every node")
                for name in NODES:
                    await asyncio.to_thread(chaos.restart, name, False)
                await asyncio.to_thread(chaos.wait_all)
                cell = Cell(path, sc, t, ph, "bench_error", 0.0, -1, -1, False, repr(e)[:80])
            log(f"{path:7s} {sc:13s} {t:7s} {ph:15s} -> {cell.outcome:12s} {cell.seconds:6.2f} s  "
                f"left {cell.blocks_left} stranded {cell.stranded} serves_after {cell.serves_after} {cell.note[:60]}")  # fmt: skip
            results.append(cell)
    if args.part == "all":
        results += await encoder_main(args, root)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few representative cells of each part")
    ap.add_argument("--part", choices=("all", "backend", "http", "encoder"), default="all")
    ap.add_argument("--scenario", action="append", help="run only this scenario's cells (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/chaos.json"))
    ap.add_argument(
        "--markdown", type=Path, default=None, help="write the table into this file's chaos section"
    )
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so running_cluster stops the node processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    results = asyncio.run(main_async(args))
    took = time.monotonic() - t0
    table = markdown(results, took)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(c) for c in results], indent=1))
    if args.markdown is not None:
        tag = "chaos-encoder" if args.part == "encoder" else "chaos"  # the encoder part: its own table
        start, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
        text = args.markdown.read_text()
        a, b = text.index(start) + len(start), text.index(end)
        args.markdown.write_text(text[:a] + "\n" + table + "\n" + text[b:])
    bad = [
        c
        for c in results
        if c.outcome.split()[0] in ("hang", "wrong_tokens", "internal_error", "broken", "bench_error")
        or "not fired" in c.outcome
        or c.blocks_left
        or c.stranded
        or not c.serves_after
    ]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()

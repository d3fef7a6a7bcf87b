"""Chaos matrix of the request lifecycle (issue 13): scenario x target x phase -> outcome.

    PYTHONPATH=$PWD .venv/bin/python bench/chaos.py [--quick] [--out bench/results/chaos.json]
                                                    [--markdown docs/reliability.md]

Real node processes on loopback (router lifecycle in-process: ``tests/e2e/faults.PhasedBackend``
is ``PDBackend`` plus a phase hook): prefill-0, prefill-1, decode-0 (``kv_load_failure_policy
reprefill``, ``kv_keepalive_s`` 0.5), every node ``kv_lease_s`` 3. Router deadlines: decode
first token 10 s, between tokens 2 s; breaker 1 failure, open 2 s.

Scenarios (the fault hits the node of the request's leg on ``target``):

    kill9          SIGKILL, then the node is restarted (fresh epoch)
    sigstop        SIGSTOP for 6 s (a frozen peer), then SIGCONT
    restart        SIGKILL and an immediate restart (the node is back during the request)
    slow_peer      SIGSTOP for 1 s (below the deadlines: slower, must still succeed)
    disconnect     the client goes away (its task is cancelled) at the phase
    drop_transfer  prefill's hold is dropped (Abort) at the phase: a lost transfer

Phases: before_prefill, after_prefill (KV held, before decode admits), during_decode (after 3
deltas), concurrent (4 clients at once, the fault fires at after_prefill of the first).
The encoder is not part of the matrix: this tree has no encoder service yet.

Per cell: outcome (ok = every token, equal to the undisturbed greedy run; retried = ok through
reprefill / local fallback / another prefill; error = a clean error delta; cancelled = the client
left; hang = past the 40 s deadline), seconds to the end of the slowest request, then after the
node is repaired and a lease has passed: KV blocks used + held + stranded on every node, and
whether a new request is served.
"""

from __future__ import annotations

import argparse
import asyncio
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
from pdserve.launcher import ports_free, start_child, wait_ready
from pdserve.rpc import node_pb2 as pb
from pdserve.rpc import node_pb2_grpc as pb_grpc
from services.router.backend import BackendRequest
from tests.e2e.cluster import running_cluster
from tests.e2e.faults import backend_for, freeze_for, signal_node
from tests.e2e.lifecycle_helpers import held_state, two_prefill_config

NODES = ["prefill-0", "prefill-1", "decode-0"]
LEASE_S = 3.0
REQUEST_DEADLINE_S = 40.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPT = [(11 * i) % 500 + 1 for i in range(120)]
SCENARIOS = ("kill9", "sigstop", "restart", "slow_peer", "disconnect", "drop_transfer")
PHASES = ("before_prefill", "after_prefill", "during_decode", "concurrent")
ROUTER = {
    "decode_first_token_timeout_s": 10.0,
    "inter_token_timeout_s": 2.0,
    "breaker_failures": 1,
    "breaker_open_s": 2.0,
}


@dataclass
class Cell:
    scenario: str
    target: str
    phase: str
    outcome: str
    seconds: float
    blocks_left: int
    stranded: int
    serves_after: bool
    note: str = ""


def cells(quick: bool) -> list[tuple[str, str, str]]:
    out = []
    for sc in SCENARIOS:
        targets = (
            ["client"]
            if sc == "disconnect"
            else ["prefill"]
            if sc == "drop_transfer"
            else ["prefill", "decode"]
        )
        for t in targets:
            for ph in PHASES:
                out.append((sc, t, ph))
    if quick:
        keep = {("kill9", "prefill", "after_prefill"), ("sigstop", "decode", "during_decode"),
                ("disconnect", "client", "after_prefill"), ("drop_transfer", "prefill", "after_prefill"),
                ("restart", "prefill", "before_prefill"), ("slow_peer", "decode", "during_decode")}  # fmt: skip
        out = [c for c in out if c in keep]
    return out


class Chaos:
    def __init__(self, rc: Any) -> None:
        self.rc = rc
        self.restart_n = 0
        self.killed: set[str] = set()

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
        wait_ready(self.rc.cluster, self.rc.children, timeout_s=120, router=False)

    async def fault(self, scenario: str, node: str) -> None:
        if scenario == "kill9":
            signal_node(self.rc, node, signal.SIGKILL)
            self.killed.add(node)
        elif scenario == "restart":
            self.restart(node, wait=False)
        elif scenario == "sigstop":
            await freeze_for(self.rc, node, 6.0)
        elif scenario == "slow_peer":
            await freeze_for(self.rc, node, 1.0)

    async def repair(self) -> None:
        for t in list(self.rc.__dict__.get("_thaw_tasks", ())):
            await t
        self.rc.__dict__["_thaw_tasks"] = set()
        for name in sorted(self.killed):
            await asyncio.to_thread(self.restart, name, False)
        self.killed.clear()
        await asyncio.to_thread(self.wait_all)


async def _drop(rc: Any, node: str, tid: str) -> None:
    import grpc

    async with grpc.aio.insecure_channel(rc.node(node).grpc_address) as ch:
        await pb_grpc.PrefillServiceStub(ch).Abort(pb.AbortRequest(transfer_ids=[tid]), timeout=5)


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
        if scenario == "drop_transfer":
            tid = (legs[rid].get("after_prefill") or legs[rid].get("before_prefill") or {}).get("transfer_id")
            p = (legs[rid].get("after_prefill") or legs[rid].get("before_prefill") or {}).get("node")
            if tid and p:
                await _drop(rc, p, tid)
            return
        if target == "decode":
            node = "decode-0"
        else:
            node = (legs[rid].get("after_prefill") or legs[rid].get("before_prefill") or {}).get(
                "node", "prefill-0"
            )
        await chaos.fault(scenario, node)

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
    await chaos.repair()
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
    errors = [o for o in outcomes if o.startswith("error")]
    if "hang" in outcomes:
        outcome = "hang"
    elif "wrong_tokens" in outcomes:
        outcome = "wrong_tokens"
    elif errors:
        outcome = "error" if len(errors) == len(outcomes) else f"error {len(errors)}/{len(outcomes)}"
    elif "cancelled" in outcomes:
        outcome = "cancelled"
    else:
        outcome = "retried" if retried else "ok"
    note = errors[0][7:90] if errors else ""
    return Cell(
        scenario, target, phase, outcome, round(seconds, 2), blocks_left, stranded, serves_after, note
    )


async def one_with(b: Any, rid: str) -> tuple[str, list[int]]:
    toks: list[int] = []
    err = None
    async for d in b.generate(BackendRequest(rid, PROMPT, GREEDY)):
        toks += d.token_ids
        if d.finish_reason == "error":
            err = d.error
    return ("error" if err else "ok"), toks


def markdown(results: list[Cell], took_s: float) -> str:
    lines = [
        "| scenario | target | phase | outcome | s to end | blocks left | stranded | serves after |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for c in results:
        lines.append(
            f"| {c.scenario} | {c.target} | {c.phase} | {c.outcome} | {c.seconds:.2f} | {c.blocks_left} | "
            f"{c.stranded} | {'yes' if c.serves_after else 'NO'} |"
        )
    notes = [f"- {c.scenario}/{c.target}/{c.phase}: {c.note}" for c in results if c.note]
    return "\n".join(
        [*lines, "", f"{len(results)} cells in {took_s:.0f} s.", "", "Error messages seen:", *notes]
    )


async def main_async(args: argparse.Namespace) -> list[Cell]:
    from pdserve.models.make_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    model = make_tiny_model("llama", root / "model")
    cfg = two_prefill_config(
        model,
        all={"kv_lease_s": LEASE_S},
        **{"decode-0": {"kv_load_failure_policy": "reprefill", "kv_keepalive_s": 0.5}},
    )
    results = []
    with running_cluster(cfg, root / "run", router=False) as rc:
        chaos = Chaos(rc)
        st, want = await one_with(backend_for(rc, **ROUTER), "reference")
        assert st == "ok" and len(want) == GREEDY.max_tokens
        for sc, t, ph in cells(args.quick):
            try:
                cell = await run_cell(chaos, want, sc, t, ph)
            except Exception as e:  # a broken cell (e.g. a port taken meanwhile) must not end the matrix
                log(f"{sc} {t} {ph}: bench error {e!r}; restarting every node")
                for name in NODES:
                    await asyncio.to_thread(chaos.restart, name, False)
                await asyncio.to_thread(chaos.wait_all)
                cell = Cell(sc, t, ph, "bench_error", 0.0, -1, -1, False, repr(e)[:80])
            log(f"{sc:14s} {t:8s} {ph:15s} -> {cell.outcome:12s} {cell.seconds:6.2f} s  "
                f"left {cell.blocks_left} stranded {cell.stranded} serves_after {cell.serves_after}")  # fmt: skip
            results.append(cell)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="6 representative cells")
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
        start, end = "<!-- chaos:begin -->", "<!-- chaos:end -->"
        text = args.markdown.read_text()
        a, b = text.index(start) + len(start), text.index(end)
        args.markdown.write_text(text[:a] + "\n" + table + "\n" + text[b:])
    bad = [
        c
        for c in results
        if c.outcome in ("hang", "wrong_tokens") or c.blocks_left or c.stranded or not c.serves_after
    ]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()

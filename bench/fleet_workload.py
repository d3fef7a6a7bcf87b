"""Fleet workloads shared by bench/fleet.py and tests/e2e/test_fleet_e2e.py: a cluster of P prefill
and D decode nodes with a Redis registry, multi-turn conversations over the completions API with
token-id prompts (so a follow-up's prompt is exactly the previous prompt + answer + new tokens),
and the nodes' prefix-cache counters.
"""

from __future__ import annotations

import random
import re
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.cluster import ClusterConfig
from services.launcher import pick_base_port
from services.router.logprobs import _byte_level_alphabet


def fleet_cluster(
    model_dir: str,
    redis_url: str,
    policy: str,
    num_prefill: int,
    num_decode: int,
    base_port: int,
    registry_ttl_s: float = 2.0,
    node_settings: dict[str, Any] | None = None,
    **router: Any,
) -> ClusterConfig:
    """Router on ``base``, then a gRPC and a metrics port per node; every node registers in Redis
    (``node_settings``: more fields of every node entry, e.g. kv_cache_memory_bytes)."""
    span = 1 + 2 * (num_prefill + num_decode)
    base = pick_base_port("127.0.0.1", base_port, span=span)
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    counts: dict[str, int] = {}
    nodes = []
    for i, role in enumerate(roles):
        k = counts[role] = counts.get(role, -1) + 1
        nodes.append(
            {
                "name": f"{role}-{k}",
                "role": role,
                "grpc_port": base + 1 + 2 * i,
                "metrics_port": base + 2 + 2 * i,
                **(node_settings or {}),
            }
        )
    return ClusterConfig.from_dict(
        {
            "model": model_dir,
            "redis_url": redis_url,
            "registry_ttl_s": registry_ttl_s,
            "router": {"port": base, "policy": policy, **router},
            "nodes": nodes,
        },
        source="fleet workload",
    )


@dataclass
class Conversation:
    history: list[int]  # the next prompt's start: every earlier prompt and answer
    turns: list[list[int]]  # each turn's new tokens (a user message)
    prompts: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    routes: list[dict[str, str]] = field(default_factory=list)


def multi_turn(
    num_convs: int, num_turns: int, first_len: int, turn_len: int, seed: int
) -> list[Conversation]:
    """Each conversation its own opening (``first_len`` tokens), then ``turn_len`` new tokens a turn."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(10, 500) for _ in range(n)]  # noqa: E731
    return [
        Conversation([], [tok(first_len)] + [tok(turn_len) for _ in range(num_turns - 1)])
        for _ in range(num_convs)
    ]


def shared_system_prompt(num_convs: int, system_len: int, user_len: int, seed: int) -> list[Conversation]:
    """One turn each: the same ``system_len`` tokens, then the conversation's own question."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 500) for _ in range(system_len)]
    return [
        Conversation([], [system + [rng.randrange(10, 500) for _ in range(user_len)]])
        for _ in range(num_convs)
    ]


class PieceIds:
    """Output token ids back from a completion's logprobs tokens (byte-level BPE pieces)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._char_of = {b: c for c, b in _byte_level_alphabet().items()}

    def __call__(self, tokens: list[str]) -> list[int]:
        ids = []
        for t in tokens:
            raw = (
                bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-fA-F]{2})", t))
                if t.startswith("bytes:")
                else t.encode()
            )
            tid = self.tokenizer.convert_tokens_to_ids("".join(self._char_of[b] for b in raw))
            assert isinstance(tid, int) and tid != self.tokenizer.unk_token_id, t
            ids.append(tid)
        return ids


def run_turn(
    client: Any, model: str, conv: Conversation, turn: int, max_tokens: int, pieces: PieceIds
) -> None:
    """One streamed completion: the conversation so far + this turn's tokens; records its answer."""
    prompt = conv.history + conv.turns[turn]
    t0 = time.monotonic()
    raw = client.completions.with_raw_response.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    route = {k: v for k, v in raw.headers.items() if k.startswith("x-pdserve-")}
    tokens: list[str] = []
    ttft = None
    for chunk in raw.parse():
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.tokens:
                if ttft is None:
                    ttft = time.monotonic() - t0
                tokens += c.logprobs.tokens
    out = pieces(tokens)
    conv.prompts.append(prompt)
    conv.outputs.append(out)
    conv.ttfts_s.append(ttft if ttft is not None else float("nan"))
    conv.routes.append(route)
    conv.history = prompt + out


def run_workload(
    client: Any,
    model: str,
    convs: list[Conversation],
    max_tokens: int,
    pieces: PieceIds,
    seed: int,
    think_s: float,
) -> None:
    """Turn by turn; within a turn the conversations in a shuffled order (seeded); ``think_s``
    between turns (a user reading the answer: the nodes' KV events reach the router meanwhile)."""
    rng = random.Random(seed)
    for turn in range(max(len(c.turns) for c in convs)):
        order = [c for c in convs if turn < len(c.turns)]
        rng.shuffle(order)
        for conv in order:
            run_turn(client, model, conv, turn, max_tokens, pieces)
        time.sleep(think_s)


def run_concurrent(
    client: Any,
    model: str,
    convs: list[Conversation],
    max_tokens: int,
    pieces: PieceIds,
    concurrency: int,
    think_s: float,
) -> None:
    """``concurrency`` conversations at a time, each its turns in order with ``think_s`` between
    them (users in parallel: the nodes' loads differ, so load-only routing moves follow-ups)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(conv: Conversation) -> None:
        for turn in range(len(conv.turns)):
            run_turn(client, model, conv, turn, max_tokens, pieces)
            time.sleep(think_s)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(one, c) for c in convs]:
            f.result()


def ideal_hit_blocks(convs: list[Conversation], block_size: int) -> int:
    """Every turn after the first hits its own history (the KV of all but the last answer token:
    that token was sampled, never fed), at most all but one prompt token (a hit leaves one)."""
    total = 0
    for c in convs:
        for t in range(1, len(c.prompts)):
            held = len(c.prompts[t - 1]) + len(c.outputs[t - 1]) - 1
            total += min(held // block_size, (len(c.prompts[t]) - 1) // block_size)
    return total


def node_counters(cluster: ClusterConfig, names: list[str] | None = None) -> dict[str, dict[str, float]]:
    """pdserve:prefix_cache_{queried,hit}_blocks of each node, from its /metrics."""
    out = {}
    for n in cluster.nodes:
        if names is not None and n.name not in names:
            continue
        with urllib.request.urlopen(f"http://{n.host}:{n.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        vals = {}
        for key in ("prefix_cache_queried_blocks", "prefix_cache_hit_blocks"):
            m = re.search(rf"^pdserve:{key}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
            vals[key] = float(m.group(1)) if m else 0.0
        out[n.name] = vals
    return out


def hit_blocks(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> float:
    return sum(
        after[n]["prefix_cache_hit_blocks"] - before.get(n, {}).get("prefix_cache_hit_blocks", 0)
        for n in after
    )

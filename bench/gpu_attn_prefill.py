"""Prefill attention implementations side by side on one CUDA device.

    PYTHONPATH=. python3 bench/gpu_attn_prefill.py --out DIR [--num-prompts 8] [--prompt-len 2000]

Llama-1B attention shape (32 query heads, 8 KV heads, head_dim 64, bf16), causal, fresh prompts
of equal length, one layer. Each row: median ms, TFLOP/s (4 * H * D * S * (S + 1) / 2 per prompt)
and the relative error against the paged Triton kernel's output on the same data:

  triton          pdserve's paged Triton kernel (keys read from the block-paged cache)
  flash-varlen    aten._flash_attention_forward, [nnz, H, D] with cumulative lengths (FA2)
  cudnn-varlen    aten._cudnn_attention_forward with cumulative lengths, GQA and K/V expanded
  sdpa-<backend>  torch SDPA on dense [B, H, S, D] forced to one backend, GQA and expanded
  njt-cudnn       SDPA on jagged nested tensors with the cuDNN backend
  cudnn-per-seq   SDPA (cuDNN) once per prompt on [1, H, S, D] views (models/cudnn_prefill.py)

Then the chunked-prefill case: one prompt whose last 500 queries come after 1,500 cached keys,
run through the varlen ops, to see which causal alignment they apply (the engine needs bottom-
right: the last query sees every key). Writes DIR/attn_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, HKV, D = 32, 8, 64
BLOCK = 16


def median_ms(fn: Any, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=2000)
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pdserve.kernels.triton_attention import paged_attention

    b, s = args.num_prompts, args.prompt_len
    dev = "cuda"
    torch.manual_seed(0)
    scale = D**-0.5
    flops = b * 4 * H * D * s * (s + 1) / 2
    q = torch.randn((b * s, H, D), dtype=torch.bfloat16, device=dev)
    k = torch.randn((b * s, HKV, D), dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    # the same keys in a paged cache, blocks in random order
    per_seq = -(-s // BLOCK)
    nblocks = b * per_seq + 1
    cache = torch.zeros((nblocks, 2, BLOCK, HKV, D), dtype=torch.bfloat16, device=dev)
    table = (torch.randperm(nblocks - 1, device=dev)[: b * per_seq] + 1).view(b, per_seq).to(torch.int32)
    pos = torch.arange(s, device=dev)
    for i in range(b):
        blk, off = table[i, pos // BLOCK].long(), pos % BLOCK
        cache[blk, 0, off] = k[i * s : (i + 1) * s]
        cache[blk, 1, off] = v[i * s : (i + 1) * s]
    seq_lens = torch.full((b,), s, dtype=torch.int32, device=dev)
    cu = torch.arange(b + 1, dtype=torch.int32, device=dev) * s
    ref = paged_attention(q, cache, table, seq_lens, cu, s, scale, 1).float()
    rows: list[dict[str, Any]] = []

    def rec(tag: str, fn: Any, to_tokens: Any = lambda o: o) -> None:
        try:
            out = to_tokens(fn()).float()
            err = float((out - ref).norm() / ref.norm())
            ms = median_ms(fn)
        except Exception as e:  # an unsupported variant is a finding, not a crash
            rows.append({"impl": tag, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            log(f"{tag:28s} error {rows[-1]['error'][:200]}")
            return
        rows.append({"impl": tag, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err})
        log(f"{tag:28s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  rel_err {err:.2e}")

    rec("triton", lambda: paged_attention(q, cache, table, seq_lens, cu, s, scale, 1))
    kx = k.repeat_interleave(H // HKV, dim=1)  # K/V expanded to every query head
    vx = v.repeat_interleave(H // HKV, dim=1)
    rec(
        "flash-varlen",
        lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, s, s, 0.0, True, False, scale=scale)[
            0
        ],
    )
    for tag, kk, vv in (("cudnn-varlen-gqa", k, v), ("cudnn-varlen-expanded", kx, vx)):
        rec(
            tag,
            lambda kk=kk, vv=vv: torch.ops.aten._cudnn_attention_forward(
                q, kk, vv, None, cu, cu, s, s, False, 0.0, True, False, scale=scale
            )[0],
        )
    # dense [B, H, S, D]
    qd = q.view(b, s, H, D).transpose(1, 2)
    kd, vd = k.view(b, s, HKV, D).transpose(1, 2), v.view(b, s, HKV, D).transpose(1, 2)
    kdx, vdx = kx.view(b, s, H, D).transpose(1, 2), vx.view(b, s, H, D).transpose(1, 2)

    def dense_to_tokens(o: torch.Tensor) -> torch.Tensor:
        return o.transpose(1, 2).reshape(b * s, H, D)

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for name, be in backends.items():
        for kind, kk, vv, gqa in (("gqa", kd, vd, True), ("expanded", kdx, vdx, False)):

            def fn(
                be: Any = be, kk: torch.Tensor = kk, vv: torch.Tensor = vv, gqa: bool = gqa
            ) -> torch.Tensor:
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(
                        qd, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa
                    )

            rec(f"sdpa-{name}-{kind}", fn, dense_to_tokens)
    # contiguous [B, H, S, D] (what a transposed copy would give)
    qc, kc, vc = qd.contiguous(), kdx.contiguous(), vdx.contiguous()

    def dense_c() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)

    rec("sdpa-cudnn-contiguous-bhsd", dense_c, dense_to_tokens)
    # nested jagged
    try:
        offsets = cu.long()
        qn = torch.nested.nested_tensor_from_jagged(q, offsets).transpose(1, 2)
        kn = torch.nested.nested_tensor_from_jagged(kx, offsets).transpose(1, 2)
        vn = torch.nested.nested_tensor_from_jagged(vx, offsets).transpose(1, 2)

        for name in ("cudnn", "flash"):

            def njt(be: Any = backends[name]) -> torch.Tensor:
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qn, kn, vn, is_causal=True, scale=scale)

            rec(f"njt-{name}", njt, lambda o: o.transpose(1, 2).values())
    except Exception as e:
        rows.append({"impl": "njt", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        log(f"njt error {e}")

    def per_seq() -> torch.Tensor:
        out = torch.empty_like(q)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for i in range(b):
                sl = slice(i * s, (i + 1) * s)
                o = F.scaled_dot_product_attention(
                    q[sl].unsqueeze(0).transpose(1, 2),
                    k[sl].unsqueeze(0).transpose(1, 2),
                    v[sl].unsqueeze(0).transpose(1, 2),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                )
                out[sl] = o[0].transpose(0, 1)
        return out

    rec("cudnn-per-seq", per_seq)

    # chunked prefill: 500 queries after 1,500 cached keys (keys 0..1999, queries at 1500..1999)
    ctx, qn_ = 2000, 500
    q1, k1, v1 = q[:qn_], k[:ctx], v[:ctx]
    cq = torch.tensor([0, qn_], dtype=torch.int32, device=dev)
    ck = torch.tensor([0, ctx], dtype=torch.int32, device=dev)
    k1x, v1x = k1.repeat_interleave(H // HKV, 1), v1.repeat_interleave(H // HKV, 1)
    qpos = torch.arange(ctx - qn_, ctx, device=dev)
    kpos = torch.arange(ctx, device=dev)
    mask = kpos[None, :] <= qpos[:, None]  # bottom-right
    want = F.scaled_dot_product_attention(
        q1.transpose(0, 1).float(),
        k1x.transpose(0, 1).float(),
        v1x.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    ).transpose(0, 1)
    topleft = F.scaled_dot_product_attention(
        q1.transpose(0, 1).float(),
        k1x.transpose(0, 1).float(),
        v1x.transpose(0, 1).float(),
        attn_mask=kpos[None, :] <= torch.arange(qn_, device=dev)[:, None],
        scale=scale,
    ).transpose(0, 1)
    chunk: dict[str, Any] = {}
    for tag, fn in (
        (
            "flash-varlen",
            lambda: torch.ops.aten._flash_attention_forward(
                q1, k1, v1, cq, ck, qn_, ctx, 0.0, True, False, scale=scale
            )[0],
        ),
        (
            "cudnn-varlen-gqa",
            lambda: torch.ops.aten._cudnn_attention_forward(
                q1, k1, v1, None, cq, ck, qn_, ctx, False, 0.0, True, False, scale=scale
            )[0],
        ),
        (
            "cudnn-varlen-expanded",
            lambda: torch.ops.aten._cudnn_attention_forward(
                q1, k1x, v1x, None, cq, ck, qn_, ctx, False, 0.0, True, False, scale=scale
            )[0],
        ),
    ):
        try:
            o = fn().float()
            chunk[tag] = {
                "err_bottom_right": float((o - want).norm() / want.norm()),
                "err_top_left": float((o - topleft).norm() / topleft.norm()),
            }
        except Exception as e:
            chunk[tag] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"chunk {tag}: {chunk[tag]}")
    # cuDNN builds an execution plan per shape: the first call of a new (batch, max_q, tokens)
    # pays it. Steps of a real server vary, so time a first call against a repeat.
    cold: list[dict[str, Any]] = []
    for nb, lens in ((3, [1700, 900, 1200]), (5, [1900, 300, 640, 2000, 77]), (2, [1333, 1100])):
        cu_ = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        n = sum(lens)
        entry: dict[str, Any] = {"batch": nb, "lens": lens}
        for kk, vv, tag in ((k[:n], v[:n], "gqa"), (kx[:n], vx[:n], "expanded")):
            try:
                times = []
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    torch.ops.aten._cudnn_attention_forward(
                        q[:n],
                        kk,
                        vv,
                        None,
                        cu_,
                        cu_,
                        max(lens),
                        max(lens),
                        False,
                        0.0,
                        True,
                        False,
                        scale=scale,
                    )
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                entry[tag] = times
            except Exception as e:
                entry[tag] = f"{type(e).__name__}: {str(e)[:200]}"
        cold.append(entry)
        log(f"cudnn varlen cold/warm ms {entry}")
    # dense per-prompt calls (what cudnn_prefill does): first call of a new length vs repeats
    dense_cold: list[dict[str, Any]] = []
    for n in (1280, 1536, 1792, 2048):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(
                    q[:n].unsqueeze(0).transpose(1, 2),
                    k[:n].unsqueeze(0).transpose(1, 2),
                    v[:n].unsqueeze(0).transpose(1, 2),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                )
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        dense_cold.append({"len": n, "ms": times})
        log(f"cudnn dense [1, H, {n}, D] first / repeat ms {times}")
    res = {
        "dense_cold_shapes": dense_cold,
        "cold_shapes": cold,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "shape": {"prompts": b, "len": s, "heads": H, "kv_heads": HKV, "head_dim": D},
        "rows": rows,
        "chunk": chunk,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attn_prefill.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

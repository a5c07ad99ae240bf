"""How close to the CPU's limit does recomputation run? Full prefill, and the fused prefill's layer loop
over a fraction r of the rows (random, sorted, as a selector leaves them) against a cache of the whole
prompt, at one prompt length: seconds per part and the arithmetic rate of each (issue 18: could a faster
engine, rather than sharing, bring the methods sweep to a third of v1's cost?).

    python -m kvf.scripts.recompute_cost [--length 6144 --ratios 0.05,0.15,0.3 --rounds 3 --threads 1]

Both run the engine's own functions (Transformer.prefill; project_qkv, attend and mlp per layer, as
FusionEngine.step calls them). FLOPs are counted as 2 per multiply-add: the projections and MLP per row,
and attention over the keys each row's block reads (attend cuts a block's keys at its last row) next to
the keys a row needs (causal: its own position + 1). Writes results/recompute_cost.md and .csv.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch
from rich.console import Console
from rich.table import Table

from kvf.pipeline.files import write_atomic
from kvf.pipeline.model import forward
from kvf.pipeline.model.rope import apply_rope
from kvf.pipeline.workflows.provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=6144)
    p.add_argument("--ratios", default="0.05,0.15,0.3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "recompute_cost.md")
    args = p.parse_args(argv)
    # one line naming the flag, as bench_allocator's (a KvfError here reached the user as a traceback)
    try:
        args.ratio_list = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"recompute_cost: --ratios {args.ratios}: expected numbers in (0, 1], e.g. 0.05,0.15") from None
    if not args.ratio_list or not all(0 < r <= 1 for r in args.ratio_list):
        raise SystemExit(f"recompute_cost: --ratios {args.ratios}: every ratio must be within (0, 1]")
    if not 64 <= args.length <= 8000:
        raise SystemExit(f"recompute_cost: --length {args.length}: must be within [64, 8000]")
    for flag, value in (("--rounds", args.rounds), ("--threads", args.threads)):
        if value < 1:
            raise SystemExit(f"recompute_cost: {flag} {value}: must be at least 1")
    return args


def linear_flops_per_row(T: forward.Transformer) -> float:
    """q, k, v and o projections and the gated MLP, one row through one layer (2 FLOPs per multiply-add)."""
    D, d, H, KV = T.config.hidden_size, T.head_dim, T.n_heads, T.n_kv_heads
    return 2.0 * (D * (H + 2 * KV) * d + H * d * D + 3 * D * T.config.intermediate_size)


def attention_flops(T: forward.Transformer, keys_per_row: torch.Tensor) -> float:
    """Scores and weighted values for rows reading `keys_per_row` keys each, one layer."""
    return 2.0 * 2 * T.n_heads * T.head_dim * float(keys_per_row.sum())


def keys_read(rows: torch.Tensor) -> torch.Tensor:
    """Keys each row's attention block reads: up to the block's last row (Transformer.attend)."""
    block = forward.ATTN_BLOCK_ROWS
    last = torch.cat([rows[min(i + block, len(rows)) - 1].repeat(min(block, len(rows) - i))
                      for i in range(0, len(rows), block)])
    return last + 1


@torch.inference_mode()
def time_full(T: forward.Transformer, ids: torch.Tensor) -> float:
    cache = T.new_cache(len(ids))
    started = time.perf_counter()
    T.prefill(ids, cache)
    return time.perf_counter() - started


@torch.inference_mode()
def time_recompute(T: forward.Transformer, ids: torch.Tensor, rows: torch.Tensor, cache) -> tuple[float, float]:
    """(attention seconds, other seconds) of one layer loop over `rows` against the filled cache."""
    mask = T.causal_mask(rows, len(ids))
    hidden = T.embed(ids[rows])                                   # [t, D]
    attention = other = 0.0
    for layer in range(T.n_layers):
        t0 = time.perf_counter()
        q, k, v = T.project_qkv(layer, hidden)                   # [H, t, d], [KV, t, d], [KV, t, d]
        cos, sin = T.rope.cos_sin(rows, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, rows, k, v)
        t1 = time.perf_counter()
        hidden = hidden + T.attend(layer, q, cache.keys(layer), cache.values(layer), mask, False, rows)
        t2 = time.perf_counter()
        hidden = T.mlp(layer, hidden)
        t3 = time.perf_counter()
        attention, other = attention + (t2 - t1), other + (t1 - t0) + (t3 - t2)
    return attention, other


def measure(args) -> pd.DataFrame:
    from kvf.pipeline.workflows.weights import load_model
    torch.set_num_threads(args.threads)
    T = forward.Transformer(load_model().model)
    n = args.length
    ids = torch.randint(100, T.config.vocab_size - 100, (n,), generator=torch.Generator().manual_seed(0))
    cache = T.new_cache(n)
    with torch.inference_mode():
        T.prefill(ids, cache)                                     # warm-up, and the cache the rows read
    per_row = linear_flops_per_row(T) * T.n_layers
    causal = torch.arange(1, n + 1)
    full_s = min(time_full(T, ids) for _ in range(args.rounds))
    full_attention = attention_flops(T, causal) * T.n_layers
    rows_out = [{"what": "full prefill", "ratio": 1.0, "rows": n, "seconds": full_s, "x_full": 1.0,
                 "attention_s": float("nan"), "other_s": float("nan"),
                 "gflops": (per_row * n + full_attention) / full_s / 1e9,
                 "attention_gflops": float("nan"), "other_gflops": float("nan"), "keys_read_over_needed": 1.0}]
    for ratio in args.ratio_list:
        rows = torch.randperm(n, generator=torch.Generator().manual_seed(1))[: max(1, round(ratio * n))].sort().values
        best = min((time_recompute(T, ids, rows, cache) for _ in range(args.rounds)), key=sum)
        read = attention_flops(T, keys_read(rows)) * T.n_layers
        needed = attention_flops(T, rows + 1) * T.n_layers
        linear = per_row * len(rows)
        rows_out.append({"what": "recompute", "ratio": ratio, "rows": len(rows), "seconds": sum(best),
                         "x_full": sum(best) / full_s, "attention_s": best[0], "other_s": best[1],
                         "gflops": (linear + read) / sum(best) / 1e9, "attention_gflops": read / best[0] / 1e9,
                         "other_gflops": linear / best[1] / 1e9, "keys_read_over_needed": read / needed})
    return pd.DataFrame(rows_out)


def write_report(df: pd.DataFrame, args, out: Path) -> None:
    cols = ["what", "ratio", "rows", "seconds", "x_full", "attention_s", "other_s", "gflops", "attention_gflops",
            "other_gflops", "keys_read_over_needed"]
    fmt = lambda v: "-" if isinstance(v, float) and v != v else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for _, r in df.iterrows()]
    full, parts = df.iloc[0], df.iloc[1:]
    at_full_rate = ", ".join(f"r = {r.ratio:g}: {r.gflops / full.gflops:.2f} of it (at full prefill's rate "
                             f"{r.x_full * r.gflops / full.gflops:.3f} x full instead of {r.x_full:.3f})"
                             for _, r in parts.iterrows())
    text = f"""# Recomputation against full prefill: how close to the CPU's limit

Made by `python -m kvf.scripts.recompute_cost --length {args.length} --ratios {args.ratios} --rounds {args.rounds} --threads {args.threads}` at commit {git_commit()}.
Conditions: SmolLM2-135M-Instruct (embedded GGUF, float32 on CPU), {args.threads} torch thread(s), {args.length} random token
ids, best of {args.rounds} rounds per row, nothing else running. `recompute` is the fused prefill's layer loop over
`rows` random rows (sorted) against the cache of the whole prompt, the engine's own functions; seconds split into
attention and the rest (projections, RoPE, cache writes, MLP). `gflops`: 2 FLOPs per multiply-add, attention
counted over the keys each row's block reads; `keys_read_over_needed`: those keys over the causal keys a row needs.

{chr(10).join(lines)}

Full prefill runs at {full.gflops:.1f} GFLOP/s here; recomputation at {at_full_rate}.
"""
    write_atomic(out, text)
    write_atomic(out.with_suffix(".csv"), df.to_csv(index=False))


def main(argv=None) -> None:
    args = parse_args(argv)
    df = measure(args)
    table = Table(title=f"recompute vs full prefill at {args.length} tokens")
    for col in ("what", "ratio", "seconds", "x_full", "gflops", "attention_gflops", "other_gflops"):
        table.add_column(col, justify="right")
    for _, r in df.iterrows():
        table.add_row(r.what, f"{r.ratio:g}", f"{r.seconds:.2f}", f"{r.x_full:.3f}", f"{r.gflops:.1f}",
                      "-" if r.attention_gflops != r.attention_gflops else f"{r.attention_gflops:.1f}",
                      "-" if r.other_gflops != r.other_gflops else f"{r.other_gflops:.1f}")
    Console().print(table)
    write_report(df, args, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()

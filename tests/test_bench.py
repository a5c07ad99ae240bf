"""`kvf bench` on a tiny random model (the GPU path's --random-weights, run on CPU), and the
loading controller's ratio choice."""
import io
import shutil

import pandas as pd
import pytest
from rich.console import Console

from kvf.errors import KvfError
from kvf.pipeline.workflows.bench import BenchOptions, bench, write_results
from kvf.pipeline.fusion.controller import choose_ratio

QUIET = Console(file=io.StringIO())


def test_controller_balances_load_and_recompute():
    # 1 MB per layer at 100 MB/s = 10 ms load; 1000 chunk tokens at 20 us per token-layer = 20 ms at r=1
    assert choose_ratio(1_000_000, 100e6, 1000, 20e-6, quality_floor=0.0) == pytest.approx(0.5)
    # never below the quality floor, never above 1
    assert choose_ratio(1_000, 100e6, 1000, 20e-6, quality_floor=0.15) == 0.15
    assert choose_ratio(10**9, 1e6, 1000, 20e-6) == 1.0


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    opts = BenchOptions(lengths=[96, 192], chunk_tokens=32, methods=["full", "reuse", "cacheblend", "fusionrag", "epic", "cachecraft"],
                        ratios=[0.15, 0.3], repeats=1, random_weights="tiny", out=out, workdir=out / "work")
    yield bench(opts, QUIET), out
    shutil.rmtree(out, ignore_errors=True)


def test_bench_measures_every_method_against_full(tiny_bench):
    df, out = tiny_bench
    warm = df[(df["mode"] == "warm") & df.pipeline & ~df.ratio_auto]
    assert set(warm.method) == {"full", "reuse", "cacheblend", "fusionrag", "epic", "cachecraft"}
    assert (warm[warm.method == "full"].ttft_ratio == 1.0).all()
    # cacheblend, fusionrag, epic and cachecraft at two ratios, full and reuse once, at both lengths
    assert len(warm) == 2 * (2 + 4 * 2)
    for _, row in warm[warm.method == "cacheblend"].iterrows():
        assert row.recomputed_tokens == int(row.ratio * row.context_tokens + 0.5)
    assert set(df["mode"]) == {"warm", "cold"}
    assert (df[df.method != "full"].read_ms > 0).all()          # KVs really came from the store
    assert (~df.pipeline).any() and df.ratio_auto.any()      # no-pipeline comparison and --ratio auto ran


def test_bench_writes_tables_and_plot(tiny_bench):
    df, out = tiny_bench
    paths = write_results(df, out, "tiny on cpu")
    assert [p.name for p in paths] == ["ttft.csv", "ttft.md", "ttft_vs_context.png"]
    assert len(pd.read_csv(paths[0])) == len(df)
    text = paths[1].read_text()
    assert "Pipelined loading" in text and "All times in ms" in text and "(auto r=" in text
    assert "Made by `kvf bench` at commit" in text and "ttft_ratio_range" in text
    assert {"ttft_ms", "load_ms", "chunk_size", "context_tokens"} <= set(pd.read_csv(paths[0]).columns)
    assert df.load_hidden.dropna().between(0, 1).all()
    assert paths[2].stat().st_size > 1000


def test_unknown_random_shape_is_refused(tmp_path):
    with pytest.raises(KvfError, match="--random-weights"):
        bench(BenchOptions(lengths=[64], random_weights="gpt-9", out=tmp_path), QUIET)


def test_rounds_time_every_method_once_each_in_a_rotating_order():
    from kvf.pipeline.workflows.bench import paired_ratio_stats, timed_rounds
    calls = []
    reps = timed_rounds([("a",), ("b",), ("c",)], 3, lambda name: calls.append(name) or {"ttft": len(calls)})
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]       # each first once, each last once
    assert [[r["ttft"] for r in rows] for rows in reps] == [[1, 6, 8], [2, 4, 9], [3, 5, 7]]
    # ratios pair a method's round with full's same round: a drift that slows both cancels out
    full = [{"ttft": 10.0}, {"ttft": 20.0}, {"ttft": 40.0}]
    method = [{"ttft": 2.5}, {"ttft": 6.0}, {"ttft": 10.0}]
    stats = paired_ratio_stats(method, full)
    assert stats == {"ttft_ratio": 0.25, "ttft_ratio_min": 0.25, "ttft_ratio_max": 0.3}
    assert paired_ratio_stats(method, None)["ttft_ratio"] != paired_ratio_stats(method, None)["ttft_ratio"]  # nan

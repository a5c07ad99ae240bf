"""`kvf bench` on a tiny random model (the GPU path's --random-weights, run on CPU), and the
loading controller's ratio choice."""
import io
import math
import re
import shutil
from collections import Counter

import pandas as pd
import pytest
from rich.console import Console

from kvf.errors import KvfError
from kvf.pipeline.workflows.bench import BenchOptions, bench, summary_table, write_results
from kvf.pipeline.fusion.controller import choose_ratio

QUIET = Console(file=io.StringIO())
SAID = Console(file=io.StringIO(), width=400)   # what the tiny bench printed


def test_controller_balances_load_and_recompute():
    # 1 MB per layer at 100 MB/s = 10 ms load; 1000 chunk tokens at 20 us per token-layer = 20 ms at r=1
    assert choose_ratio(1_000_000, 100e6, 1000, 20e-6, quality_floor=0.0) == pytest.approx(0.5)
    # never below the quality floor, never above 1
    assert choose_ratio(1_000, 100e6, 1000, 20e-6, quality_floor=0.15) == 0.15
    assert choose_ratio(10**9, 1e6, 1000, 20e-6) == 1.0


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    opts = BenchOptions(lengths=[96, 192], chunk_tokens=32, methods=["full", "reuse", "cacheblend", "fusionrag", "epic", "cachecraft",
                                                                 "cacheblend:deviation=v"],
                        ratios=[0.15, 0.3], repeats=1, random_weights="tiny", out=out, workdir=out / "work")
    yield bench(opts, SAID), out
    shutil.rmtree(out, ignore_errors=True)


def test_bench_measures_every_method_against_full(tiny_bench):
    df, out = tiny_bench
    warm = df[(df["mode"] == "warm") & df.pipeline & ~df.ratio_auto]
    assert set(warm.method) == {"full", "reuse", "cacheblend", "fusionrag", "epic", "cachecraft"}
    # an entry with its own knobs (as on kvf run) is timed apart and labelled by them
    assert set(warm[warm.method == "cacheblend"].label) == {"cacheblend@0.15", "cacheblend@0.3",
                                                          "cacheblend [deviation=v]@0.15", "cacheblend [deviation=v]@0.3"}
    assert (warm[warm.method == "full"].ttft_ratio == 1.0).all()
    # cacheblend, fusionrag, epic and cachecraft at two ratios, full and reuse once, at both lengths
    assert len(warm) == 2 * (2 + 5 * 2)
    for _, row in warm[warm.method == "cacheblend"].iterrows():
        assert row.recomputed_tokens == int(row.ratio * row.context_tokens + 0.5)
    assert set(df["mode"]) == {"warm", "cold"}
    assert (df[df.method != "full"].read_ms > 0).all()          # KVs really came from the store
    assert (~df.pipeline).any() and df.ratio_auto.any()      # no-pipeline comparison and --ratio auto ran


def test_bench_says_up_front_how_many_requests_it_will_time(tiny_bench):
    """The defaults time hundreds of requests up to 8K tokens (hours on a CPU): the first line says how many,
    and that count is what the benchmark then timed (one round per mode here: one row each)."""
    df, _ = tiny_bench
    first = SAID.file.getvalue().splitlines()[0]
    entries = len(df) // (2 * 2)                          # per length and mode
    assert first.startswith(f"kvf bench: {entries} entries x 2 lengths (up to 192 tokens) x 1 round x 2 store states "
                            f"(warm and cold) = {len(df)} timed requests"), first   # it said "x 2 rounds (warm and cold)"
    assert first.endswith("--lengths or --rounds"), first                  # the README's word, not --repeats
    assert "--lengths" in first


def test_bench_writes_tables_and_plot(tiny_bench):
    df, out = tiny_bench
    paths = write_results(df, out, "tiny on cpu")
    assert [p.name for p in paths] == ["ttft.csv", "rounds.csv", "ttft.md", "ttft_vs_context.png"]
    assert len(pd.read_csv(paths[0])) == len(df)
    rounds = pd.read_csv(paths[1])   # every timed request, one round here
    assert len(rounds) == len(df) and (rounds.ttft_ms.to_numpy() == df.ttft_ms.to_numpy()).all()
    text = paths[2].read_text()
    assert "Pipelined loading" in text and "All times in ms" in text and "(auto r=" in text
    assert "Made by `kvf bench` at commit" in text and "ttft_ratio_range" in text
    assert {"ttft_ms", "load_ms", "chunk_size", "context_tokens"} <= set(pd.read_csv(paths[0]).columns)
    assert df.load_hidden.dropna().between(0, 1).all()
    assert paths[3].stat().st_size > 1000
    shown = Console(file=io.StringIO(), width=200)
    shown.print(summary_table(df, "t"))
    lines = shown.file.getvalue().splitlines()
    assert any("cacheblend [deviation=v]@0.15" in line for line in lines)   # the label, not swallowed as markup
    first = df[df.pipeline].iloc[0]   # every column in its place: the TTFT and its ratio beside the label
    assert any(first.label in line and f"{first.ttft_ms:.1f}" in line and f"{first.ttft_ratio:.3f}" in line
               for line in lines)
    narrow = Console(file=io.StringIO(), width=60)
    narrow.print(summary_table(df, "t", width=60))
    text = narrow.file.getvalue()
    assert "not shown at this width: " in text and "peak/KV" in text.split("not shown")[1]
    assert any(first.label in line and f"{first.ttft_ms:.1f}" in line and f"{first.ttft_ratio:.3f}" in line
               for line in text.splitlines())                               # rows still on one line each


def test_versus_pairs_round_by_round_with_an_interval():
    from kvf.pipeline.workflows.bench import add_versus, paired_interval
    assert paired_interval([2.0, 4.0, 2.0], [1.0, 2.0, 1.0]) == pytest.approx((2.0, 2.0, 2.0))
    ratio, low, high = paired_interval([1.1, 0.9, 1.2, 0.95], [1.0, 1.0, 1.0, 1.0])
    assert ratio == pytest.approx((1.1 * 0.9 * 1.2 * 0.95) ** 0.25) and low < 1 < high   # geometric mean
    row = dict(length=64, mode="warm", pipeline=True, ratio_auto=False)
    df = pd.DataFrame([dict(row, method="full", spec=None, ratio=1.0, round_ttfts=(4.0, 4.0)),
                       dict(row, method="prophetkv", spec=None, ratio=0.15, round_ttfts=(1.0, 2.0)),
                       dict(row, method="kvfuse", spec=None, ratio=0.15, round_ttfts=(1.1, 2.2)),
                       dict(row, method="kvfuse", spec="propagate=off", ratio=0.15, round_ttfts=(1.0, 2.0)),
                       dict(row, method="kvfuse", spec=None, ratio=0.3, round_ttfts=(2.0, 3.0)),
                       dict(row, method="reuse", spec=None, ratio=0.0, round_ttfts=(0.5, 1.0))])
    got = add_versus(df, "prophetkv")
    assert got.vs_ratio.tolist()[2:4] == pytest.approx([1.1, 1.0])          # paired per round, same ratio only
    assert got.vs_ratio.isna().tolist() == [True, True, False, False, True, False]  # not full, itself, or another ratio
    assert got.vs_ratio.tolist()[5] == pytest.approx(0.5)   # reuse has no ratio: paired with prophetkv's only one
    two_ratios = pd.concat([df, pd.DataFrame([dict(row, method="prophetkv", spec=None, ratio=0.3, round_ttfts=(2, 3))])])
    assert math.isnan(add_versus(two_ratios.reset_index(drop=True), "prophetkv").vs_ratio.tolist()[5])   # which one?
    assert add_versus(df, "kvfuse:propagate=off").vs_ratio.tolist()[1] == pytest.approx(1.0)


def test_versus_adds_a_paired_plot(tiny_bench, tmp_path):
    """--versus: the md section and a plot of every entry's paired ratio with its interval, beside the others."""
    from kvf.pipeline.workflows.bench import add_versus
    df, _ = tiny_bench
    paths = write_results(add_versus(df, "cacheblend"), tmp_path, "tiny on cpu", versus="cacheblend")
    assert [p.name for p in paths] == ["ttft.csv", "rounds.csv", "ttft.md", "ttft_vs_context.png", "ttft_paired.png"]
    assert "## Paired with cacheblend, round by round" in paths[2].read_text()
    assert paths[4].stat().st_size > 1000


def test_replot_draws_from_the_committed_files_what_the_run_drew(tiny_bench, tmp_path, monkeypatch):
    """scripts/replot_bench: the plots drawn again from ttft.csv, rounds.csv and ttft.md get the same rows, rounds,
    device label and --versus as the run's own plots."""
    from kvf.pipeline.workflows import bench as bench_module
    from kvf.pipeline.workflows.bench import add_versus, replot
    from kvf.scripts.replot_bench import main as replot_main
    drawn = []
    monkeypatch.setattr(bench_module, "plot_ratio_vs_length", lambda df, path, label: drawn.append(("length", df, label)))
    monkeypatch.setattr(bench_module, "plot_paired", lambda df, path, versus, label: drawn.append((versus, df, label)))
    df, _ = tiny_bench
    write_results(add_versus(df, "cacheblend"), tmp_path, "tiny on cpu", versus="cacheblend")
    by_run = list(drawn)
    drawn.clear()
    assert [p.name for p in replot(tmp_path)] == ["ttft_vs_context.png", "ttft_paired.png"]
    assert [(kind, label) for kind, _, label in drawn] == [(kind, label) for kind, _, label in by_run] \
        == [("length", "tiny on cpu"), ("cacheblend", "tiny on cpu")]
    columns = ["length", "mode", "label", "pipeline", "ratio_auto", "ratio", "ttft_ratio", "vs_ratio", "vs_low", "vs_high"]
    for (_, got, _), (_, want, _) in zip(drawn, by_run):
        pd.testing.assert_frame_equal(got[columns].reset_index(drop=True), want[columns].reset_index(drop=True),
                                      check_dtype=False)
        assert [len(r) for r in got.round_ttfts] == [len(r) for r in want.round_ttfts]
        assert [t for r in got.round_ttfts for t in r] == pytest.approx([t for r in want.round_ttfts for t in r])
    (tmp_path / "rounds.csv").unlink()
    assert replot_main([str(tmp_path)]) == 1                                   # a folder kvf bench did not write


def test_full_prefill_is_timed_even_when_not_named(tmp_path):
    """`kvf bench -m prophetkv,kvfuse` printed '-' in every "x full" cell: nothing divided by full prefill."""
    df = bench(BenchOptions(lengths=[96], chunk_tokens=32, methods=["reuse"], ratios=[0.15], repeats=1,
                            random_weights="tiny", out=tmp_path, modes=("warm",), compare_no_pipeline=False,
                            auto_ratio=False), QUIET)
    assert list(df.method) == ["full", "reuse"]
    assert df.set_index("method").ttft_ratio["reuse"] > 0


def test_versus_must_name_a_timed_entry(tmp_path):
    with pytest.raises(KvfError, match=r"--versus prophetkv: no -m entry is prophetkv.*reuse"):
        bench(BenchOptions(lengths=[64], methods=["full", "reuse"], random_weights="tiny", out=tmp_path,
                           versus="prophetkv"), QUIET)
    # nothing to pair it with: found after every timing, it wrote an empty table "over the 0 rounds"
    with pytest.raises(KvfError, match=re.escape("--versus cacheblend: no other -m entry is timed at its ratio "
                                                 "(0.15, 0.3) to pair with it; add one")):
        bench(BenchOptions(lengths=[64], methods=["full", "cacheblend"], ratios=[0.15, 0.3], random_weights="tiny",
                           out=tmp_path, versus="cacheblend"), QUIET)


def test_unknown_random_shape_is_refused(tmp_path):
    with pytest.raises(KvfError, match="--random-weights"):
        bench(BenchOptions(lengths=[64], random_weights="gpt-9", out=tmp_path), QUIET)


def test_a_length_past_the_model_is_refused_before_any_work(tmp_path, monkeypatch):
    """--lengths 20000 on a 4K model was cut to 4,095 tokens without a word (the table said 4095); now it is
    refused, naming the longest length that fits, before the first length is timed."""
    import kvf.pipeline.workflows.bench as bench_module
    def never(*args, **kwargs):
        raise AssertionError("a length was prepared before the check")
    monkeypatch.setattr(bench_module, "prepare_length", never)
    with pytest.raises(KvfError, match="--lengths 20000: the model holds 4,096 positions; use lengths up to 4,096"):
        bench(BenchOptions(lengths=[96, 20000], methods=["full"], random_weights="tiny", out=tmp_path), QUIET)


def test_a_length_too_short_for_s_and_q_is_refused_before_the_plan_is_said(tmp_path, monkeypatch):
    """--lengths 10 printed the plan ("1 lengths ... x 4 rounds") and only then said the length was too short."""
    import kvf.pipeline.workflows.bench as bench_module
    monkeypatch.setattr(bench_module, "prepare_length", lambda *a, **k: pytest.fail("a length was prepared"))
    said = Console(file=io.StringIO())
    with pytest.raises(KvfError, match="--lengths 50: too short for the system prefix and question .* at least 65"):
        bench(BenchOptions(lengths=[96, 50], methods=["full"], random_weights="tiny", out=tmp_path), said)
    assert said.file.getvalue() == ""


def test_rounds_time_every_method_once_each_in_a_balanced_order():
    from kvf.pipeline.workflows.bench import paired_ratio_stats, round_orders, timed_rounds
    calls = []
    reps = timed_rounds([("a",), ("b",), ("c",)], 3, lambda name: calls.append(name) or {"ttft": len(calls)})
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]       # every round times every entry once
    assert [[r["ttft"] for r in rows] for rows in reps] == [[1, 6, 8], [2, 4, 9], [3, 5, 7]]
    for n in range(2, 7):  # Williams: each entry first equally often, right after each other equally often
        orders = round_orders(n)
        follows = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
        assert all(sorted(order) == list(range(n)) for order in orders)
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
        assert len(set(Counter(order[0] for order in orders).values())) == 1
    # ratios pair a method's round with full's same round: a drift that slows both cancels out
    full = [{"ttft": 10.0}, {"ttft": 20.0}, {"ttft": 40.0}]
    method = [{"ttft": 2.5}, {"ttft": 6.0}, {"ttft": 10.0}]
    stats = paired_ratio_stats(method, full)
    assert stats == {"ttft_ratio": 0.25, "ttft_ratio_min": 0.25, "ttft_ratio_max": 0.3}
    assert paired_ratio_stats(method, None)["ttft_ratio"] != paired_ratio_stats(method, None)["ttft_ratio"]  # nan


def test_no_timed_request_runs_under_the_memory_setting(tmp_path, monkeypatch):
    """Fixing glibc's mmap threshold (for peak memory) slows big allocations: every timed request comes
    before it, and the peaks come from requests after it."""
    import kvf.pipeline.workflows.bench as bench_module
    events = []
    monkeypatch.setattr(bench_module, "fixed_mmap_threshold", lambda *a: events.append("memory setting"))
    real = bench_module.timed_request

    def recorded(*args, **kwargs):
        measuring = (len(args) > 6 and args[6] is not None) or kwargs.get("memory") is not None
        events.append("peak request" if measuring else "timed request")
        return real(*args, **kwargs)
    monkeypatch.setattr(bench_module, "timed_request", recorded)
    opts = BenchOptions(lengths=[96], chunk_tokens=32, methods=["full", "cacheblend"], ratios=[0.15], repeats=2,
                        modes=("warm",), compare_no_pipeline=False, auto_ratio=False, random_weights="tiny",
                        out=tmp_path, workdir=tmp_path / "work")
    df = bench(opts, QUIET)
    first_setting = events.index("memory setting")
    assert events[:first_setting] == ["timed request"] * (2 + 2 * 2)       # warm-ups, then 2 rounds of 2
    assert events[first_setting:].count("peak request") == 2 and "timed request" not in events[first_setting:]
    assert (df.peak_bytes >= 0).all() and len(df) == 2


def test_bench_without_a_workdir_leaves_no_store_behind(tmp_path, monkeypatch):
    """Each length's store is hundreds of MB at real lengths: a temp work dir goes when the benchmark ends,
    also when it stops with an error; a --store / workdir the user named stays."""
    import tempfile
    import kvf.pipeline.workflows.bench as bench_module
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
    opts = BenchOptions(lengths=[96], chunk_tokens=32, methods=["full", "reuse"], repeats=1, modes=("warm",),
                        compare_no_pipeline=False, auto_ratio=False, random_weights="tiny", out=tmp_path / "out")
    stores_made = []
    real_prepare = bench_module.prepare_length

    def recorded(*args):
        setup = real_prepare(*args)
        stores_made.append(args[5])
        return setup
    monkeypatch.setattr(bench_module, "prepare_length", recorded)

    def left_behind():   # torch may put its own caches in the temp dir too
        return [p.name for p in temp_root.iterdir() if p.name.startswith("kvf-")]
    df = bench(opts, QUIET)
    assert len(df) == 2 and stores_made and stores_made[0].parent == temp_root
    assert left_behind() == []

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_module, "time_length", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench(opts, QUIET)
    assert len(stores_made) == 2 and left_behind() == []

    monkeypatch.setattr(bench_module, "time_length", interrupted)
    kept = tmp_path / "kept"
    with pytest.raises(KeyboardInterrupt):
        bench(BenchOptions(**{**opts.__dict__, "workdir": kept}), QUIET)
    assert (kept / "store-96.zarr").is_dir()


def test_recompute_cost_refuses_bad_arguments_in_one_line():
    from kvf.scripts import recompute_cost
    for argv, fragment in ((["--length", "10"], "--length 10"), (["--ratios", "abc"], "--ratios abc"),
                           (["--ratios", "0"], "--ratios 0"), (["--rounds", "0"], "--rounds 0"),
                           (["--threads", "0"], "--threads 0")):
        with pytest.raises(SystemExit) as refused:
            recompute_cost.parse_args(argv)
        message = str(refused.value.code)
        assert message.startswith("recompute_cost: ") and fragment in message and "\n" not in message


def test_bench_allocator_refuses_bad_arguments_in_one_line():
    from kvf.scripts import bench_allocator
    for argv, fragment in ((["--rounds", "0"], "--rounds 0"), (["--length", "0"], "--length 0"),
                           (["-m", "full,nope"], "--method nope")):
        with pytest.raises(SystemExit) as refused:
            bench_allocator.parse_args(argv)
        message = str(refused.value.code)
        assert message.startswith("bench_allocator: ") and fragment in message and "\n" not in message


def test_bench_json_is_the_only_thing_on_stdout(tmp_path, capsys, monkeypatch):
    """`kvf bench --json | jq`: the 'wrote ...' line and the --repeats 1 warning go to stderr."""
    import json
    import sys

    from kvf.cli.main import main
    monkeypatch.setattr(sys, "argv", ["kvf", "bench", "--random-weights", "tiny", "--lengths", "96", "--chunk-tokens",
                                      "32", "-m", "full,reuse", "--repeats", "1", "--no-cold", "--no-compare-no-pipeline",
                                      "--no-auto-ratio", "--json", "-o", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None), err
    assert {row["method"] for row in json.loads(out)} == {"full", "reuse"}
    assert "wrote" in err and "--repeats 1 gives one timing" in err
    argv = [w if w != "--repeats" else "--rounds" for w in sys.argv]   # it said "--repeats 1" to --rounds 1
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code in (0, None) and "--rounds 1 gives one timing" in capsys.readouterr().err


def test_the_length_plot_draws_the_ratios_that_were_timed(monkeypatch, tmp_path):
    """`kvf bench -r 0.3` drew an empty plot: the lines were drawn at 0.15 only. Without 0.15 every timed ratio
    is drawn; with it, 0.15 alone (the title says so). The x ticks are the lengths measured, as numbers."""
    from kvf.pipeline.workflows import bench as bench_module
    drawn = {}
    monkeypatch.setattr(bench_module, "save_with_legend_outside", lambda fig, ax, path: drawn.update(ax=ax))

    def rows(ratios):
        out = [dict(method="full", label="full", ratio=1.0, ttft_ratio=1.0, ttft_ms=500.0 * n / 256, length=n)
               for n in (256, 512)]
        out += [dict(method="cacheblend", label=f"cacheblend@{r:g}", ratio=r, ttft_ratio=0.2 + r, ttft_ms=100.0, length=n)
                for r in ratios for n in (256, 512)]
        df = pd.DataFrame(out)
        df["mode"], df["pipeline"], df["ratio_auto"] = "warm", True, False
        df["ttft_ratio_min"], df["ttft_ratio_max"] = df.ttft_ratio - 0.01, df.ttft_ratio + 0.01
        return df

    for ratios, labels, title in (([0.3], ["cacheblend@0.3"], "recompute ratio 0.3,"),
                                  ([0.05, 0.3], ["cacheblend@0.05", "cacheblend@0.3"], None),
                                  ([0.05, 0.15, 0.3], ["cacheblend@0.15"], "recompute ratio 0.15,")):
        bench_module.plot_ratio_vs_length(rows(ratios), tmp_path / "p.png", "tiny on cpu")
        ax = drawn["ax"]
        assert sorted(c.get_label() for c in ax.containers) == labels
        assert (title in ax.get_title()) if title else "recompute ratio" not in ax.get_title()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "512"]


def test_methods_without_a_ratio_are_drawn_and_labelled_without_one(monkeypatch, tmp_path):
    """bench's label and length plot knew the methods without a ratio knob by a literal list that lacked
    prefix and ceiling, and a row with its own knobs ('ape [...]') missed it too: prefix was labelled 'prefix@0'
    and, with 0.15 timed, left out of the plot. Every method that ignores --ratio is drawn as its own line."""
    from kvf.pipeline.workflows import bench as bench_module
    drawn = {}
    monkeypatch.setattr(bench_module, "save_with_legend_outside", lambda fig, ax, path: drawn.update(ax=ax))
    out = []
    for n in (256, 512):
        out += [dict(method="full", spec="", ratio=1.0, ttft_ratio=1.0, ttft_ms=500.0, length=n),
                dict(method="cacheblend", spec="", ratio=0.15, ttft_ratio=0.3, ttft_ms=150.0, length=n),
                dict(method="prefix", spec="", ratio=0.0, ttft_ratio=0.1, ttft_ms=50.0, length=n),
                dict(method="ape", spec="temperature=0.5", ratio=0.0, ttft_ratio=0.1, ttft_ms=50.0, length=n)]
    df = pd.DataFrame(out)
    df["mode"], df["pipeline"], df["ratio_auto"] = "warm", True, False
    df["label"] = [bench_module.method_label(row) for _, row in df.iterrows()]
    assert sorted(set(df.label)) == ["ape [temperature=0.5]", "cacheblend@0.15", "full", "prefix"]
    bench_module.plot_ratio_vs_length(df, tmp_path / "p.png", "tiny on cpu")
    lines = {line.get_label() for line in drawn["ax"].get_lines()}
    assert {"prefix", "ape [temperature=0.5]"} <= lines
    assert [c.get_label() for c in drawn["ax"].containers] == ["cacheblend@0.15"]
    # `kvf bench -m full` alone: no other row to draw, and no error (an empty mask once selected columns)
    bench_module.plot_ratio_vs_length(df[df.method == "full"], tmp_path / "p.png", "tiny on cpu")
    assert [line.get_label() for line in drawn["ax"].get_lines()] == ["full prefill"]


def test_a_length_named_twice_is_timed_once():
    """`--lengths 256,256` timed 256 twice and wrote two rows for it in ttft.csv and the table."""
    from kvf.cli.bench_cmd import _ints
    assert _ints("256,256,512,256", "--lengths") == [256, 512]


def test_a_long_label_is_broken_after_a_knob_into_lines_that_keep_every_character():
    from kvf.pipeline.workflows.display import wrapped_label
    label = "kvfuse [" + ":".join(f"knob_{i}={i * 7}" for i in range(12)) + "]@0.15"
    lines = wrapped_label(label, width=30).split("\n")
    assert len(lines) > 1 and max(map(len, lines)) <= 30 and "".join(lines) == label
    assert all(line.endswith(":") for line in lines[:-1])                      # broken between knobs, never inside
    assert wrapped_label("kvfuse@0.15", width=30) == "kvfuse@0.15"


def test_a_long_legend_label_goes_under_the_axes_and_the_title_stays_on_the_figure(tmp_path):
    """kvfuse's located sinks as a bench entry ('kvfuse [sink_tokens=8:...:locate_to=0.85]@0.15', 72 characters):
    the legend to the right squeezed the axes to a sliver and pushed their title off the figure's left edge.
    A label past LEGEND_RIGHT_CHARS puts the legend under the axes; short labels keep it to the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from kvf.pipeline.workflows import bench as bench_module
    seeds_after = ("kvfuse [sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:hop_rows=16:hop_seeds=band:"
                   "hop_weight=0:hop_after=12]@0.15")
    for label, below in (("kvfuse [sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85]@0.15", True),
                         (seeds_after, True), ("kvfuse@0.15", False)):
        fig = Figure(figsize=(7.5, 4.2))
        FigureCanvasAgg(fig)                                                   # a renderer to measure with
        ax = fig.subplots()
        ax.plot([0, 1], [1.0, 0.98], label=label)
        ax.set_title("TTFT paired with prophetkv, round by round (a device label of some length)\nsecond line")
        bench_module.save_with_legend_outside(fig, ax, tmp_path / "p.png")
        renderer = fig.canvas.get_renderer()
        legend, axes_box = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert (legend.y1 <= axes_box.y0) == below and (legend.x0 >= axes_box.x1) == (not below)
        title = ax.title.get_window_extent(renderer)
        assert title.x0 >= 0 and title.x1 <= fig.bbox.x1                      # the title is on the figure
        assert legend.x0 >= 0 and legend.x1 <= fig.bbox.x1 and legend.y0 >= 0  # and so is the legend (step 19's
        # 115-character label ran past both edges)
        assert (tmp_path / "p.png").stat().st_size > 0

"""The arithmetic of `make bench-scale`'s per-question sweep cost (the timings themselves are a
benchmark, not a test): when each question's records were all written, and the distinct prefills'
own layer-loop seconds that no exact sharing removes."""
import json
import re

import pandas as pd
import pytest
import torch

from kvf.scripts.bench_scale import QUIET, own_prefill_seconds, question_ends


def test_question_ends_are_the_first_samples_with_all_of_a_questions_records(tmp_path):
    seen = [(0.1, 0), (1.0, 2), (1.5, 3), (2.0, 4), (2.5, 4), (4.0, 6)]
    assert question_ends(seen, 6, 3, tmp_path / "run.jsonl") == [1.0, 2.0, 4.0]


def test_uneven_records_per_question_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="run.jsonl"):
        question_ends([(1.0, 5)], 5, 2, tmp_path / "run.jsonl")


def record(qid, method, ratio, variant, seconds, shared=()):
    return {"qid": qid, "method": method, "settings": {"ratio": ratio, "variant": variant},
            "timings": {"recompute": seconds}, "shared": list(shared)}


def test_a_prefill_shared_by_several_records_is_counted_once():
    records = []
    for qid, scale in (("q1", 10.0), ("q2", 1.0)):
        records += [record(qid, "full", 1.0, "prefix", 3 * scale, ["prefill:full"]),
                    record(qid, "reuse", 0.0, "prefix", 1 * scale),
                    record(qid, "cacheblend", 0.0, "prefix", 1 * scale, ["reuse-prefill:prefix"]),
                    record(qid, "epic", 0.0, "prefix", 1 * scale, ["reuse-prefill:prefix"]),
                    record(qid, "fusionrag", 0.0, "fusion", 0.5 * scale, ["reuse-prefill:fusion"]),
                    record(qid, "cacheblend", 0.3, "prefix", 2 * scale)]
    assert own_prefill_seconds(records, skip_first=False) == pytest.approx((65 + 6.5) / 2)
    assert own_prefill_seconds(records) == pytest.approx(6.5)  # the first question is start-up


@pytest.mark.parametrize("flag,value", [("--share-questions", "1"), ("--sweep-questions", "2")])
def test_too_few_questions_for_a_steady_rate_is_one_line_naming_the_flag(flag, value):
    from kvf.scripts.bench_scale import parse_args
    with pytest.raises(SystemExit, match=f"{flag} {value}: needs at least"):
        parse_args([flag, value])


def test_real_questions_need_a_prepared_dataset_named_in_one_line(tmp_path):
    from kvf.scripts.bench_scale import parse_args
    with pytest.raises(SystemExit, match=f"--real {tmp_path}: no questions.jsonl there; prepare it first"):
        parse_args(["--real", str(tmp_path)])
    with pytest.raises(SystemExit, match="--real-questions 1: needs at least"):
        parse_args(["--real-questions", "1"])


BUILD_CSV = ("compute_dtype,chunk_tokens,entry_ms,prefill_ms,rest_ms,chunks_per_s,tokens_per_s,entry_mb,model,device\n"
             "bfloat16,256,100.0,60.0,40.0,10.0,2560.0,33.8,llama3-8b,H100\n"
             "float32,256,250.0,160.0,90.0,4.0,1024.0,33.8,llama3-8b,H100\n")


def test_the_projection_takes_gpu_hours_from_build_caches_measured_entry_cost(tmp_path):
    """results/gpu/build.csv's bfloat16 row (kvf's default on CUDA) gives seconds per chunk, in proportion to tokens."""
    from kvf.scripts.bench_scale import ROOT, gpu_build_cost, projection
    table = tmp_path / "build.csv"
    table.write_text(BUILD_CSV)
    cost = gpu_build_cost(table)
    assert cost["seconds_per_chunk"] == pytest.approx(0.1) and cost["chunk_tokens"] == 256
    measured = {"bytes_per_token": 1.0, "tokens_per_core_s": 1.0}
    proj = projection(1e6, 256, 8, measured, cost)
    assert proj["gpu_hours_measured"] and proj["llama_gpu_hours"] == pytest.approx(1e6 * 0.1 / 3600)
    assert proj["llama_wall_hours"] == pytest.approx(proj["llama_gpu_hours"] / 8)
    assert projection(1e6, 512, 8, measured, cost)["llama_gpu_hours"] == pytest.approx(2 * proj["llama_gpu_hours"])
    assert not projection(1e6, 256, 8, measured)["gpu_hours_measured"]
    assert gpu_build_cost(tmp_path / "absent.csv") is None
    committed = gpu_build_cost(ROOT / "results" / "gpu" / "build.csv")  # the H100 run of results/gpu/build.md
    assert 50 < committed["entry_ms"] < 200 and committed["chunk_tokens"] == 256 and not committed["in_a_row"]
    # a table that times entries built in a row, writes behind, gives that cost: it is how build-cache runs
    in_a_row = gpu_build_cost(ROOT / "results" / "gpu" / "h200-f7556d7" / "build.csv")
    assert in_a_row["in_a_row"] and in_a_row["gpu"] == "H200"
    assert in_a_row["seconds_per_chunk"] == pytest.approx(75.333 / 1000, rel=1e-3) != in_a_row["entry_ms"] / 1000


@pytest.mark.parametrize("text", ["", "compute_dtype,entry_ms\nbfloat16,1\n", "\x00\xff binary"])
def test_a_gpu_build_table_that_is_not_bench_gpu_builds_is_one_line_naming_the_flag(tmp_path, text):
    from kvf.scripts.bench_scale import gpu_build_cost
    table = tmp_path / "build.csv"
    table.write_bytes(text.encode("latin-1"))
    with pytest.raises(SystemExit, match=f"--gpu-build {table}: not bench_gpu_build's table"):
        gpu_build_cost(table)


def test_the_gpu_build_bench_writes_the_table_the_projection_reads(tmp_path):
    """scripts/bench_gpu_build on the CPU (tiny shape): one row per compute dtype, each entry the bytes of
    a float16 KV of the chunk's tokens and its separator (2 layers x K,V x 2 heads x 16 dims x 2 bytes)."""
    from kvf.scripts import bench_gpu_build
    from kvf.scripts.bench_scale import gpu_build_cost
    out = tmp_path / "build.md"
    assert bench_gpu_build.main(["--device", "cpu", "--random-weights", "tiny", "--chunks", "2", "--chunk-tokens", "32",
                                 "--out", str(out)]) == 0
    import pandas as pd
    rows = pd.read_csv(out.with_suffix(".csv"))
    assert list(rows["compute_dtype"]) == ["bfloat16", "float32"]
    per_token = 2 * 2 * 2 * 16 * 2
    tokens = rows["entry_mb"] * 1e6 / per_token
    assert (tokens == tokens.round()).all() and (tokens > 32).all() and (tokens < 40).all()
    assert gpu_build_cost(out.with_suffix(".csv"))["chunk_tokens"] == 32
    assert "Made by `python -m kvf.scripts.bench_gpu_build" in out.read_text()


@pytest.mark.parametrize("flags,fragment", [(["--chunks", "0"], "--chunks 0: must be >= 1"),
                                            (["--chunk-tokens", "0"], "--chunk-tokens 0: must be >= 1"),
                                            (["--compute-dtypes", "bfloat16,fp8"], "--compute-dtypes fp8: use one of"),
                                            (["--random-weights", "llama9"], "--random-weights llama9: known shapes"),
                                            (["--device", "tpu"], "--device tpu: kvf runs on cpu or cuda")])
def test_a_bad_gpu_build_bench_flag_is_one_line_before_any_model_is_made(flags, fragment, tmp_path, capsys):
    from kvf.scripts import bench_gpu_build
    args = ["--device", "cpu", "--random-weights", "tiny", "--out", str(tmp_path / "build.md"), *flags]
    assert bench_gpu_build.main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvf: error: {fragment}"), err
    assert not (tmp_path / "build.md").exists()


def test_rerendering_the_committed_numbers_gives_the_committed_report(tmp_path):
    """results/scale.md is its numbers (scale.json) rendered: --rerender writes it again, word for word but the
    commit, from scale.json and results/gpu/build.csv. A report that a run measured (no rendered_by) names
    that run's command, as the run did."""
    from kvf.scripts.bench_scale import ROOT, parse_args, rerender
    committed = ROOT / "results" / "scale.md"
    args = parse_args(["--rerender", str(ROOT / "results" / "scale.json"), "--out", str(tmp_path / "scale.md")])
    rendered_by = json.loads((ROOT / "results" / "scale.json").read_text()).get("rendered_by")
    rerender(args, rendered_by)
    commit = re.compile(r"at commit [0-9a-f]{7,}(-dirty)?")   # a working tree with edits reads -dirty
    assert commit.sub("", (tmp_path / "scale.md").read_text()) == commit.sub("", committed.read_text())


def test_the_cost_ratio_s_interval_resamples_each_question_s_two_costs_together(tmp_path):
    """shared / v1 per question gets a 95% bootstrap interval over the steady questions, each question's cost under
    both codes drawn together: questions whose ratio is the same give an interval of that ratio alone, however
    different their costs; a run measured before per-question costs were kept renders without one."""
    from kvf.eval.stats import ratio_of_means_interval
    from kvf.scripts.bench_scale import ROOT, cost_interval, parse_args, report
    v1 = [150.0, 190.0, 171.0, 160.0, 182.0]
    assert ratio_of_means_interval([0.8 * c for c in v1], v1) == pytest.approx((0.8, 0.8))
    low, high = cost_interval([120.0, 150.0, 140.0, 120.0, 160.0], v1)
    assert low < (120 + 150 + 140 + 120 + 160) / sum(v1) < high and high - low < 0.2
    assert cost_interval(None, v1) is None and cost_interval([1.0, 2.0], v1) is None
    numbers = json.loads((ROOT / "results" / "scale.json").read_text())
    v1_name, _, shared_name = numbers["share"]
    for name, each in zip(numbers["share"], ([38.0, 37.0, 39.0], [41.0, 40.0, 42.0], [14.0, 17.5, 14.1])):
        numbers["share"][name]["each"] = each
    numbers["real"] |= {"v1_each": [171.0, 170.6], "shared_each": [128.0, 148.4]}
    out = tmp_path / "scale.md"
    args = parse_args(["--rerender", str(ROOT / "results" / "scale.json"), "--out", str(out)])
    report(args, numbers, QUIET)
    md = out.read_text()
    assert md.count("| vs v1 [95% CI] |") == 2
    share, v1 = numbers["share"][shared_name], numbers["share"][v1_name]
    low, high = ratio_of_means_interval([14.0, 17.5, 14.1], [38.0, 37.0, 39.0])
    assert f"| {shared_name} | {share['questions']} | {share['answers']} | {share['per_question']:.1f} | " \
           f"{share['per_question'] / v1['per_question']:.2f} [{low:.2f}, {high:.2f}] |" in md
    real = numbers["real"]
    low, high = ratio_of_means_interval([128.0, 148.4], [171.0, 170.6])   # 128/171 and 148.4/170.6
    assert f"| {real['shared'] / real['v1']:.2f} [{low:.2f}, {high:.2f}] |" in md and (low, high) < (0.76, 0.88)
    assert f"Shared / v1 = **{real['shared'] / real['v1']:.2f}** (95% interval [{low:.2f}, {high:.2f}]" in md
    saved = json.loads(out.with_suffix(".json").read_text())
    assert (saved["real_shared_over_v1_low"], saved["real_shared_over_v1_high"]) == pytest.approx((low, high))


def test_rerender_of_a_file_that_is_not_bench_scales_numbers_is_one_line(tmp_path):
    from kvf.scripts.bench_scale import parse_args, rerender
    bad = tmp_path / "scale.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match=f"--rerender {bad}: not a bench_scale .json"):
        rerender(parse_args(["--rerender", str(bad)]), "x")


def test_recompute_cost_counts_the_flops_torch_counts(monkeypatch):
    """scripts/recompute_cost's FLOPs for one layer over some rows are what torch's FlopCounterMode counts
    for the engine's own calls: the projections and MLP per row, attention over the keys each block reads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from conftest import tiny_model
    from kvf.pipeline.model import forward
    from kvf.pipeline.model.rope import apply_rope
    from kvf.scripts.recompute_cost import attention_flops, keys_read, linear_flops_per_row
    monkeypatch.setattr(forward, "ATTN_BLOCK_ROWS", 2)
    T = forward.Transformer(tiny_model("llama"))
    n, rows = 10, torch.tensor([0, 5, 6, 9])
    assert keys_read(rows).tolist() == [6, 6, 10, 10]               # blocks [0, 5] and [6, 9] read up to 6 and 10
    ids = torch.arange(n)
    cache = T.new_cache(n)
    with torch.inference_mode():
        T.prefill(ids, cache)
        hidden = T.embed(ids[rows])
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):   # attention as matmuls it counts
            q, k, v = T.project_qkv(0, hidden)
            cos, sin = T.rope.cos_sin(rows, q.dtype)
            q = apply_rope(q, cos, sin)
            hidden = hidden + T.attend(0, q, cache.keys(0), cache.values(0), T.causal_mask(rows, n), False, rows)
            T.mlp(0, hidden)
    assert counter.get_total_flops() == linear_flops_per_row(T) * len(rows) + attention_flops(T, keys_read(rows))


def test_the_drivers_costs_are_measured_and_projected_per_chunk_and_per_pair():
    """Part 4b: chunking and indexing stay on a Ray build's driver, so the projection counts its embedding (per
    chunk) and its neighbour search apart from the GPUs'. Measured here on a small scale: twice the corpus is
    twice the embedding; up to the exact limit four times the search (every pair), above it 2^1.5 times (the
    inverted file), and a scale.json timed before the approximate search projects every size as pairs."""
    from kvf.scripts.bench_scale import driver_rows, measure_driver, projection
    driver = measure_driver("The Kettar mountains lie north of the Ossel sea. " * 40, 64, 3, 2_000, 3_000,
                            n_chunks=8, exact_up_to=1_000)
    assert driver["embed_chunks_per_s"] > 0 and driver["embedder_tokens"] == 64
    assert driver["knn_seconds"] > 0 and driver["approx_seconds"] > 0 and driver["exact_up_to"] == 1_000
    measured = {"bytes_per_token": 1.0, "tokens_per_core_s": 1.0}
    one, two = (projection(n, 64, 8, measured, None, driver) for n in (1e6, 2e6))
    assert two["driver_embed_core_hours"] == pytest.approx(2 * one["driver_embed_core_hours"])
    assert two["driver_knn_core_hours"] == pytest.approx(2 ** 1.5 * one["driver_knn_core_hours"])
    assert one["driver_knn_core_hours"] == pytest.approx(driver["approx_seconds"] * (1e6 / 3_000) ** 1.5 / 3600)
    small, twice_small = (projection(n, 64, 8, measured, None, driver) for n in (500, 1_000))
    assert twice_small["driver_knn_core_hours"] == pytest.approx(4 * small["driver_knn_core_hours"])
    older = {k: v for k, v in driver.items() if not k.startswith("approx") and k != "exact_up_to"}
    assert projection(1e6, 64, 8, measured, None, older)["driver_knn_core_hours"] == pytest.approx(
        driver["knn_seconds"] * (1e6 / 2_000) ** 2 / 3600)
    assert one["driver_embed_core_hours"] == pytest.approx(1e6 / driver["embed_chunks_per_s"] / 3600)
    rows = driver_rows(one, driver)
    assert [row[0] for row in rows] == ["any (driver)"] * 2 and rows[1][1].startswith("approximate 3 neighbours")
    assert driver_rows(small, driver)[1][1].startswith("exact 3 neighbours")
    assert "driver_embed_core_hours" not in projection(1e6, 64, 8, measured)   # numbers measured before part 4b


@pytest.mark.parametrize("flags,fragment", [(["--measure-driver"], "--measure-driver: only with --rerender"),
                                            (["--neighbours", "10", "--knn-vectors", "5"], "need 1 <= neighbours"),
                                            (["--approx-vectors", "50000"], "--approx-vectors 50000: the search is exact")])
def test_bad_driver_flags_are_one_line(flags, fragment):
    from kvf.scripts.bench_scale import parse_args
    with pytest.raises(SystemExit, match=fragment):
        parse_args(flags)


def test_chunk_table_bench_opens_the_same_table_both_ways(capsys):
    """scripts/bench_chunk_table: each way holds every chunk of the table it wrote, measured in its own process."""
    from kvf.scripts.bench_chunk_table import main
    results = main(["--chunks", "300", "--tokens", "8"])
    assert [r["chunks"] for r in results.values()] == [300, 300]
    out = capsys.readouterr().out
    assert "300 chunks x 8 tokens" in out and "chunk objects" in out and "ChunkTable" in out
    with pytest.raises(SystemExit, match="--chunks, --tokens and --neighbours must be at least 1"):
        main(["--chunks", "0"])


def test_chunk_table_driver_bench_chunks_the_same_corpus_both_ways(capsys):
    """bench_chunk_table --driver: both ways chunk the corpus it wrote into the same number of chunks."""
    from kvf.scripts.bench_chunk_table import main
    results = main(["--driver", "--chunks", "40"])
    chunks = [r["chunks"] for r in results.values()]
    assert chunks[0] == chunks[1] >= 40
    assert f"into {chunks[0]:,} chunks" in capsys.readouterr().out


def test_neighbours_bench_loads_the_same_neighbours_both_ways(capsys):
    """bench_chunk_table --neighbours: the older JSON and neighbours.npz hold every chunk, loaded in their own processes."""
    from kvf.scripts.bench_chunk_table import main
    results = main(["--neighbours", "3", "--chunks", "50"])
    assert [r["chunks"] for r in results.values()] == [50, 50]
    assert "3 neighbours of each of 50 chunks" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--neighbours must be at least 1"):
        main(["--neighbours", "0"])


def test_chunk_table_bench_ratio_against_a_base_that_measured_nothing():
    """A tiny run can add no resident memory in its baseline: the ratio column says n/a instead of dividing by 0."""
    from kvf.scripts.bench_chunk_table import times
    assert times(3.0, 1.5) == "2.00x"
    assert times(3.0, 0.0) == "n/a" and times(3.0, -1.0) == "n/a"


@pytest.mark.long
def test_s3_bench_reads_the_same_each_way(capsys, monkeypatch, tmp_path):
    """scripts/bench_s3 on a tiny store, straight to moto and through the latency proxy: the requests one after
    another and side by side plan, list and load the same, and so do the rolled-up listing and the HEADs before it
    (the bench exits when they differ)."""
    pytest.importorskip("moto")
    from kvf.scripts.bench_s3 import main
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)   # the bench sets them; restored after
    results = main(["--rtt-ms", "0,5", "--repeats", "1", "--entries", "8", "--chunks", "2", "--build-chunks", "1",
                    "--out", str(tmp_path / "s3.md")])
    assert list(results) == [0.0, 5.0] and all(len(medians) == 10 for medians in results.values())
    out = capsys.readouterr().out
    assert "s per 8 entries" in out and "s per 4 entries" in out and "s per prompt of 2 chunks" in out
    assert "s per 1 entries built" in out
    table = pd.read_csv(tmp_path / "s3.csv")
    assert len(table) == 10 and set(table.work) == {"planning", "listing", "listing vs HEADs", "loading", "building"}
    assert ((table.now_over_before - table.now_s / table.before_s).abs() / table.now_over_before).max() < 1e-4
    text = (tmp_path / "s3.md").read_text()
    assert "Made by `python -m kvf.scripts.bench_s3 --rtt-ms 0,5 --repeats 1 --entries 8 --chunks 2 --build-chunks 1`" in text
    assert "the same keys and bytes" in text
    for flags, fragment in ((["--rtt-ms", "x"], "--rtt-ms x: give milliseconds"),
                            (["--entries", "1"], "--entries at least 2"),
                            (["--build-chunks", "-1"], "--build-chunks -1: give 0")):
        with pytest.raises(SystemExit):
            main(flags)
        assert fragment in capsys.readouterr().err


def test_the_rows_floor_counts_every_prefills_token_layers_in_full_prefills():
    from types import SimpleNamespace

    from kvf.scripts.bench_scale import prefills_recomputed, rows_floor

    def rec(qid, method, token_layers):
        return SimpleNamespace(qid=qid, method=method, recomputed_token_layers=token_layers)

    records = [rec("q1", "full", 300), rec("q1", "epic", 30), rec("q1", "cacheblend", 60), rec("q1", "reuse", 0),
               rec("q2", "epic", 50), rec("q2", "full", 100)]
    assert prefills_recomputed(records) == pytest.approx((390 / 300 + 150 / 100) / 2)
    assert rows_floor({"full": 20.0, "prefills_recomputed": 1.4}) == pytest.approx(28.0)


def test_the_floor_names_the_new_tokens_its_records_were_answered_with():
    from kvf.scripts.bench_scale import V1_RECORDS_6K, new_tokens_said, v1_split_at_6k

    at_6k = v1_split_at_6k(V1_RECORDS_6K)   # v1's committed MuSiQue sweep: answered with --max-new-tokens 12
    assert at_6k["max_new_tokens"] == [12]
    assert new_tokens_said(at_6k) == "12 new tokens"
    assert new_tokens_said({"max_new_tokens": [8, 12]}) == "8 or 12 new tokens"
    assert new_tokens_said({}) == "new tokens as their settings say"

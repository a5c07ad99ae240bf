"""The arithmetic of `make bench-scale`'s per-question sweep cost (the timings themselves are a
benchmark, not a test): when each question's records were all written, and the distinct prefills'
own layer-loop seconds that no exact sharing removes."""
import pytest
import torch

from kvf.scripts.bench_scale import own_prefill_seconds, question_ends


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


def test_the_projection_takes_gpu_hours_from_the_measured_full_prefill_rate(tmp_path):
    """results/gpu/ttft.csv's warm full rows give tokens/s per length; the shortest length's rate is used."""
    from kvf.scripts.bench_scale import ROOT, gpu_full_prefill_rate, projection
    table = tmp_path / "ttft.csv"
    table.write_text("length,method,mode,ttft_ms\n4096,full,warm,100.0\n16384,full,warm,800.0\n"
                     "4096,reuse,warm,10.0\n4096,full,cold,999.0\n")
    rate = gpu_full_prefill_rate(table)
    assert rate["tokens_per_s"] == {4096: pytest.approx(40960.0), 16384: pytest.approx(20480.0)}
    measured = {"bytes_per_token": 1.0, "tokens_per_core_s": 1.0}
    proj = projection(1e6, 256, 8, measured, rate)
    assert proj["gpu_hours_measured"] and proj["llama_gpu_hours"] == pytest.approx(256e6 / 40960.0 / 3600)
    assert proj["llama_wall_hours"] == pytest.approx(proj["llama_gpu_hours"] / 8)
    assert not projection(1e6, 256, 8, measured)["gpu_hours_measured"]
    assert gpu_full_prefill_rate(tmp_path / "absent.csv") is None
    committed = gpu_full_prefill_rate(ROOT / "results" / "gpu" / "ttft.csv")  # the H100 run of results/gpu.md
    assert 25_000 < committed["tokens_per_s"][4096] < 35_000


@pytest.mark.parametrize("text", ["", "length,method\n4096,full\n", "\x00\xff binary"])
def test_a_gpu_table_that_is_not_kvf_benchs_is_one_line_naming_the_flag(tmp_path, text):
    from kvf.scripts.bench_scale import gpu_full_prefill_rate
    table = tmp_path / "ttft.csv"
    table.write_bytes(text.encode("latin-1"))
    with pytest.raises(SystemExit, match=f"--gpu-table {table}: not a `kvf bench` table"):
        gpu_full_prefill_rate(table)


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

"""The method contract on a CUDA GPU, where CI cannot go (it has no GPU: these skip there).

On a random-weight model of the embedded model's real shape (SmolLM2-135M: 30 layers, 9 query and
3 KV heads of 64 dims) and a ~1K-token prompt of three chunks, with the stored chunk KVs handed
over on the CPU as the store hands them:
- float32: every method at its compute-everything setting equals full prefill on the GPU within
  1e-3 on first-token logits (as on the CPU);
- bfloat16 (kvf's default on CUDA): no method at that setting is further from float32 full prefill
  than bfloat16 full prefill itself is (times a small slack), while reuse is far further: the
  fused path adds no error of its own beyond the dtype's rounding;
- every method recomputes its budget on the GPU, and its first-token logits and recomputed count
  at 15% equal the CPU's (float32, within 1e-3): the device code paths compute the same thing.

Run on a GPU machine: `pytest -m gpu tests/test_gpu.py`.
"""
import pytest
import torch

from conftest import SMOLLM2_SHAPE, oracle_method, recomputes_chunks, stored_prefix_kvs
from kvf.pipeline.fusion.engine import FusionEngine, recompute_budget
from kvf.pipeline.fusion.methods import METHODS, get_method, method_names
from kvf.pipeline.fusion.sources import InMemoryKV
from kvf.pipeline.model.forward import Transformer
from kvf.pipeline.model.prompt import FusedPrompt

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: run `pytest -m gpu tests/test_gpu.py` on one", allow_module_level=True)

NAMES = method_names()
RATIO = 0.15


def engine_on(device: str, dtype: torch.dtype) -> FusionEngine:
    """The same random weights (seed 0) on any device and dtype."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_SHAPE), dtype=torch.float32,
                                             attn_implementation="sdpa")
    return FusionEngine(Transformer(model.to(device, dtype).eval()))


@pytest.fixture(scope="module")
def prompts():
    """S | C1 C2 C3 | Q of 24 + (300, 420, 260) + 20 tokens (over one 256-row attention block), and S | C1 | Q."""
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, SMOLLM2_SHAPE["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    many = FusedPrompt(ids(24), [ids(n) for n in (300, 420, 260)], ids(20))
    one = FusedPrompt(many.prefix_ids, many.chunk_segments[:1], many.question_ids)
    return {"many": many, "one": one}


class Case:
    """One engine with its stored chunk KVs (on the CPU, as a store hands them) and full prefill's logits."""

    def __init__(self, device, dtype, prompts):
        self.engine = engine_on(device, dtype)
        self.sources, self.full = {}, {}
        for key, prompt in prompts.items():
            exact = stored_prefix_kvs(self.engine, prompt)
            self.sources[key] = InMemoryKV([kv.cpu() for kv in exact.chunk_kvs], exact.chunk_extras)
            self.full[key] = get_method("full").prefill(self.engine, prompt).logits.float().cpu()

    def logits(self, method, prompt, key):
        return method.prefill(self.engine, prompt, self.sources[key]).logits.float().cpu()


@pytest.fixture(scope="module")
def cases(prompts):
    return {name: Case(device, dtype, prompts) for name, device, dtype in
            (("cuda32", "cuda", torch.float32), ("cuda16", "cuda", torch.bfloat16), ("cpu32", "cpu", torch.float32))}


def key_for(method) -> str:
    return "many" if recomputes_chunks(method) else "one"


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", NAMES)
def test_compute_everything_equals_full_on_cuda_in_float32(cases, prompts, name):
    case, method = cases["cuda32"], oracle_method(name)
    key = key_for(method)
    assert max_diff(case.logits(method, prompts[key], key), case.full[key]) <= 1e-3


def test_bfloat16_guard_reuse_is_far_from_full(cases, prompts):
    """The bf16 oracle below can fail: reuse of three chunks is many times bf16's own error away."""
    noise = max_diff(cases["cuda16"].full["many"], cases["cuda32"].full["many"])
    reuse = cases["cuda16"].logits(get_method("reuse"), prompts["many"], "many")
    assert max_diff(reuse, cases["cuda32"].full["many"]) > 5 * noise


@pytest.mark.parametrize("name", NAMES)
def test_compute_everything_in_bfloat16_adds_no_error_beyond_the_dtype(cases, prompts, name):
    method = oracle_method(name)
    key = key_for(method)
    exact = cases["cuda32"].full[key]
    noise = max_diff(cases["cuda16"].full[key], exact)          # bf16 full prefill vs float32
    got = max_diff(cases["cuda16"].logits(method, prompts[key], key), exact)
    assert got <= 2 * noise, (got, noise)


@pytest.mark.parametrize("name", NAMES)
def test_cuda_recomputes_the_cpus_tokens_and_gives_its_logits(cases, prompts, name):
    method = get_method(name, RATIO)
    prompt, source_key = prompts["many"], "many"
    on_cuda = method.prefill(cases["cuda32"].engine, prompt, cases["cuda32"].sources[source_key])
    on_cpu = method.prefill(cases["cpu32"].engine, prompt, cases["cpu32"].sources[source_key])
    assert on_cuda.recomputed_tokens == on_cpu.recomputed_tokens
    assert on_cuda.recomputed_token_layers == on_cpu.recomputed_token_layers
    assert max_diff(on_cuda.logits.float().cpu(), on_cpu.logits) <= 1e-3
    if METHODS[name].ratio_is_knob:
        slack = 0 if METHODS[name].exact_budget else len(prompt.chunk_segments)
        assert abs(on_cuda.recomputed_tokens - recompute_budget(RATIO, prompt.n_chunk_tokens)) <= slack


@pytest.mark.parametrize("name", ["reuse", "cacheblend"])
def test_a_store_read_straight_to_the_gpu_fuses_like_the_same_kvs_in_memory(cases, prompts, tmp_path, name):
    """Reader threads, pinned buffers and the side copy stream hand the engine the very bytes stored:
    bit-equal logits to the same float16 KVs handed over from CPU memory; a corrupt layer still raises."""
    from kvf.cachestore import CorruptEntry, open_store
    from kvf.pipeline.fusion.sources import StoreKVSource
    case, prompt = cases["cuda16"], prompts["many"]
    model = case.engine.model
    store = open_store(str(tmp_path / "store"), "zarr", create=True,
                       meta={"model": "gpu-test", "dtype": "float16", "layers": model.n_layers,
                             "kv_heads": model.n_kv_heads, "head_dim": model.head_dim})
    keys = [f"{i:02d}" + "0" * 62 for i in range(len(prompt.chunk_segments))]
    for key, kv in zip(keys, case.sources["many"].chunk_kvs):
        store.put(key, kv)
    in_memory = InMemoryKV([store.get(key) for key in keys])                 # float16, on the CPU
    expected = get_method(name, RATIO).prefill(case.engine, prompt, in_memory).logits
    for pipeline in (False, True):
        source = StoreKVSource(store, keys, model.n_layers, pipeline=pipeline)
        got = get_method(name, RATIO).prefill(case.engine, prompt, source)
        source.close()
        assert torch.equal(got.logits, expected), pipeline
        assert source.read_seconds > 0
    layer_file = tmp_path / "store" / keys[1][:2] / keys[1] / "kv" / "c.7.0.0.0.0"
    data = bytearray(layer_file.read_bytes())
    data[10] ^= 0x40
    layer_file.write_bytes(bytes(data))
    source = StoreKVSource(open_store(str(tmp_path / "store"), readonly=True), keys, model.n_layers)
    with pytest.raises(CorruptEntry, match="checksum"):
        get_method(name, RATIO).prefill(case.engine, prompt, source)
    source.close()


def test_kvfuse_keeps_a_device_copy_on_the_gpu_and_shifts_as_the_cpu_does(cases, prompts, monkeypatch):
    """On a GPU the engine copies the rows kvfuse's pass 2 overwrites (at device memory bandwidth) instead of
    reading the store again after the first token, as it does on the CPU: the source is not read again, and
    the shifted cache decoding reads is the CPU's (float32)."""
    prompt, n = prompts["many"], prompts["many"].n_tokens
    source = cases["cuda32"].sources["many"]
    reads = []
    monkeypatch.setattr(source, "read_again", lambda layer, chunks: reads.append(layer) or [])
    on_cuda = get_method("kvfuse", RATIO).prefill(cases["cuda32"].engine, prompt, source)
    on_cpu = get_method("kvfuse", RATIO).prefill(cases["cpu32"].engine, prompt, cases["cpu32"].sources["many"])
    assert on_cuda.after_first_token is not None                  # the shift waits for decoding on the GPU too
    got, want = on_cuda.cache.kv[:, :, :, :n].float().cpu(), on_cpu.cache.kv[:, :, :, :n]
    assert max_diff(got, want) <= 1e-3 and reads == []


def test_a_prefill_and_a_fusion_pass_wait_for_the_gpu_a_few_times_not_once_per_layer(cases, prompts):
    """A CPU index or position tensor handed to a kernel is a copy that waits for every kernel queued
    before it. Placed once per pass (ActiveRows), the host waits for the GPU a few times per prefill,
    however many layers the model has; before, it waited three times per layer (the RoPE positions and
    the cache rows of K and V), so the host could never run ahead and launch the next layer's kernels
    while the GPU ran this one's."""
    from kvf.scripts.bench_gpu_build import host_waits
    case, prompt = cases["cuda32"], prompts["many"]
    engine, layers = case.engine, case.engine.model.n_layers
    chunk = prompt.chunk_segments[0]
    waits = {
        "full prefill": host_waits(lambda: get_method("full").prefill(engine, prompt)),
        "chunk_kv": host_waits(lambda: engine.chunk_kv(chunk, prompt.prefix_ids, None)),
        "epic@0.15": host_waits(lambda: get_method("epic", RATIO).prefill(engine, prompt, case.sources["many"])),
    }
    assert all(n < layers for n in waits.values()), (waits, layers)

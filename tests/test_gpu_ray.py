"""Ray's GPU workers (`--ray --device cuda`) on a CUDA GPU, where CI cannot go (it has no GPU: these skip).

tests/test_ray.py checks the distributed contract with CPU actors. Here the actors ask Ray for a GPU
each and compute on it, with a random-weight model of the embedded model's real shape (SmolLM2-135M:
30 layers, 9 query and 3 KV heads of 64 dims) and a byte-level BPE tokenizer trained on the corpus
(kvf.pipeline.workflows.bench.train_bpe_tokenizer: a GPU machine has no model files):
- a Ray build equals a one-process build on the same GPU: same keys, same bytes; and those bytes are
  the GPU's (a CPU build of the same weights in the same dtype differs), so the actors did compute on it;
- a GPU actor killed with SIGKILL mid-batch is restarted on the GPU, and the store ends the same;
- `kvf run --ray --device cuda` writes the same records as a one-process run on the GPU;
- the default is one worker per GPU, and asking for more is one line naming the flag and the room.

Run on a GPU machine with Ray installed: `pytest -m gpu tests/test_gpu_ray.py`.
"""
import json
import sys

import numpy as np
import pytest
import torch

from conftest import SMOLLM2_SHAPE

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: run `pytest -m gpu tests/test_gpu_ray.py` on one", allow_module_level=True)
pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvf[ray]')")

from test_ray import QUIET, answers, build_killing_a_worker  # noqa: E402  (after the skips: it needs Ray)

BUILD = dict(chunk_tokens=32, variants=("prefix",), bm25=False, dense=False, batch=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A synthetic corpus, a random-weight SmolLM2-shaped model directory, and a one-process build on
    the GPU (the reference)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from kvf.pipeline.data.synthetic import make_synthetic
    from kvf.pipeline.workflows.bench import train_bpe_tokenizer
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    root = tmp_path_factory.mktemp("gpu-ray")
    make_synthetic(root / "data", n_questions=6, passages_per_question=3, seed=1)
    passages = [json.loads(line)["text"] for line in (root / "data" / "corpus" / "passages.jsonl").read_text().splitlines()]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(root / "model")
    train_bpe_tokenizer(passages).save_pretrained(root / "model")
    build_cache(BuildOptions(corpus=root / "data" / "corpus", workspace=root / "one", model=str(root / "model"),
                             device="cuda", **BUILD), QUIET)
    return root


@pytest.fixture(scope="module")
def ray_local():
    import ray
    from kvf.pipeline.workflows.distributed import start_ray
    yield start_ray("local", threads=1)
    ray.shutdown()


def stored(path) -> dict:
    from kvf.cachestore import open_store
    store = open_store(str(path))
    return {key: store.get(key).numpy() for key in store.keys()}


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_gpu_workers_build_what_one_process_builds_on_the_gpu(ray_local, corpus):
    from kvf.cachestore import open_store
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    n_gpus = int(ray_local.cluster_resources()["GPU"])
    options = dict(corpus=corpus / "data" / "corpus", model=str(corpus / "model"), **BUILD)
    summary = build_cache(BuildOptions(workspace=corpus / "ray", ray="local", device="cuda", **options), QUIET)
    assert any(f"ray ×{n_gpus}" in s.name for s in summary.stages)             # one worker per GPU
    one, on_ray = stored(corpus / "one" / "kv.zarr"), stored(corpus / "ray" / "kv.zarr")
    assert len(one) > 50 and same_bytes(one, on_ray)
    assert open_store(str(corpus / "ray" / "kv.zarr")).verify() == []
    # the GPU's bytes, not the CPU's: a CPU build in the same compute dtype (so the same keys) of a few chunks
    # (one shard: bfloat16 crawls on a CPU without it) differs
    build_cache(BuildOptions(workspace=corpus / "cpu", device="cpu", compute_dtype="bfloat16", shard=(0, 16),
                             **options), QUIET)
    on_cpu = stored(corpus / "cpu" / "kv.zarr")
    assert len(on_cpu) >= 2 and on_cpu.keys() <= one.keys()
    assert any(not np.array_equal(one[key], on_cpu[key]) for key in on_cpu)


def test_a_gpu_worker_killed_mid_batch_is_restarted_and_the_store_is_the_same(corpus, tmp_path):
    markers = tmp_path / "pids"
    markers.mkdir()
    args = [sys.executable, "-m", "kvf", "build-cache", str(corpus / "data" / "corpus"), "-w", str(tmp_path / "ws"),
            "--model", str(corpus / "model"), "--device", "cuda", "--chunk-tokens", "32", "--variant", "prefix",
            "--no-bm25", "--no-dense", "--ray", "local", "--batch", "4"]
    killed, returncode, err = build_killing_a_worker(args, markers, poll=0.005)
    assert killed is not None, "no worker was caught mid-batch"
    assert returncode == 0, err[-2000:]
    assert same_bytes(stored(corpus / "one" / "kv.zarr"), stored(tmp_path / "ws" / "kv.zarr"))


def test_run_on_gpu_workers_equals_one_process_run_on_the_gpu(ray_local, corpus):
    from kvf.pipeline.workflows.run import RunOptions, run
    common = dict(methods=["full", "reuse", "cacheblend"], ratios=[0.15], dataset=corpus / "data",
                  workspace=corpus / "one", model=str(corpus / "model"), device="cuda", max_new_tokens=4, warmup=False)
    run(RunOptions(out=corpus / "one.jsonl", **common), QUIET)
    run(RunOptions(out=corpus / "ray.jsonl", ray="local", **common), QUIET)
    one, n_one = answers(corpus / "one.jsonl")
    on_ray, n_ray = answers(corpus / "ray.jsonl")
    assert n_one == n_ray == 18 and one == on_ray


def test_more_gpu_workers_than_gpus_are_refused_in_one_line(ray_local):
    from kvf.errors import KvfError
    from kvf.pipeline.workflows.distributed import worker_count
    n_gpus = int(ray_local.cluster_resources()["GPU"])
    assert worker_count(ray_local, None, "cuda", 1) == n_gpus
    with pytest.raises(KvfError, match=rf"^--workers {n_gpus + 1}: the Ray cluster has {n_gpus} GPUs .*"
                                       rf"pass --workers {n_gpus} or fewer"):
        worker_count(ray_local, n_gpus + 1, "cuda", 1)

"""Scale-out on Ray (`--ray local`, two actors on this machine): a distributed build equals a
one-process build byte for byte, also when a worker is killed with SIGKILL mid-batch (its actor is
restarted and the batch retried); `kvf run --ray` writes the same records as a one-process run, also when a
worker is killed mid-question, and a resumed distributed run adds only what is missing. Skipped with the
reason where Ray is not installed.
The builds and runs use a 2-layer random Llama with SmolLM2's tokenizer (what Ray hands out and collects is the
same for any model); the SIGKILL tests, run by make test-long, use the embedded model, whose batches and
questions last long enough to be caught mid-task, and so check that the actors load it."""
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from rich.console import Console

from conftest import RAISING_METHOD_ERROR, assert_one_line, model_of, tiny_llama_dir, write_raising_method

pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvf[ray]')")

QUIET = Console(file=io.StringIO())
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
BUILD = dict(chunk_tokens=32, variants=("prefix", "fusion"), n_neighbours=2, dtype="float32", bm25=False)


@pytest.fixture(scope="module")
def ray_local():
    import ray
    from kvf.pipeline.workflows.distributed import start_ray
    yield start_ray("local", threads=1)
    ray.shutdown()


def one_process_build(root, **settings):
    """A synthetic corpus (55 chunks of 32 tokens) under root/data and its one-process build, the reference."""
    from kvf.pipeline.data.synthetic import make_synthetic
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    make_synthetic(root / "data", n_questions=3, passages_per_question=3, seed=1)
    torch.set_num_threads(1)  # the actors run one thread each: same kernels, same bits
    build_cache(BuildOptions(corpus=root / "data" / "corpus", workspace=root / "one", **BUILD, **settings), QUIET)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The reference build by a tiny model (root/model, passed as `model` by every build and run here)."""
    root = tmp_path_factory.mktemp("ray")
    yield one_process_build(root, model=str(tiny_llama_dir(root / "model")))
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def embedded_corpus(tmp_path_factory):
    """The reference build by the embedded model, whose batches last long enough to kill a worker mid-batch."""
    root = tmp_path_factory.mktemp("ray-embedded")
    yield one_process_build(root)
    shutil.rmtree(root, ignore_errors=True)


def tiny(corpus) -> dict:
    """BUILD with the tiny model of `corpus`."""
    return {**BUILD, "model": model_of(corpus)}


def assert_same_store(a_path, b_path):
    from kvf.cachestore import open_store
    a, b = open_store(str(a_path)), open_store(str(b_path))
    assert a.keys() == b.keys() and len(a.keys()) > 50
    for key in a.keys():
        assert np.array_equal(a.get(key).numpy(), b.get(key).numpy()), key
    assert b.verify() == []


def test_ray_build_equals_one_process_build(ray_local, corpus, tmp_path, monkeypatch):
    """...and the driver never loads the model: the actors compute S's entry too (a driver's copy of the model
    held GPU memory that the actor on that GPU needed). Actors start only for missing work: a resumed build
    started every actor, each loading the model (a minute for Llama-3-8B on 8 GPUs), to find nothing to do."""
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    from kvf.pipeline.workflows.weights import ModelRef
    monkeypatch.setattr(ModelRef, "load", lambda *a, **k: pytest.fail("the driver loaded the model"))
    summary = build_cache(BuildOptions(corpus=corpus / "data" / "corpus", workspace=corpus / "ray", ray="local",
                                       workers=2, batch=4, **tiny(corpus)), QUIET)
    assert_same_store(corpus / "one" / "kv.zarr", corpus / "ray" / "kv.zarr")
    assert any("ray ×2" in s.name for s in summary.stages)
    manifest = json.loads((corpus / "ray" / "manifest.json").read_text())
    assert manifest["variants"] == ["fusion", "prefix"]
    from kvf.pipeline.workflows import distributed
    with monkeypatch.context() as m:   # resumed with nothing left to do: no actor loads the model for nothing
        m.setattr(distributed, "actor_class", lambda *a: pytest.fail("an actor started with nothing to build"))
        again = build_cache(BuildOptions(corpus=corpus / "data" / "corpus", workspace=corpus / "ray", ray="local",
                                         workers=2, **tiny(corpus)), QUIET)
    assert again.entries_written == 0 and not any("ray" in s.name for s in again.stages)
    # a corpus grown by one short document: one batch, so one actor, whatever --workers allows
    shutil.copytree(corpus / "data" / "corpus", tmp_path / "corpus")
    shutil.copytree(corpus / "ray", tmp_path / "ray")
    (tmp_path / "corpus" / "new.txt").write_text("Quorbel Vantrich founded the Drelvan glassworks in 1802.")
    grown = build_cache(BuildOptions(corpus=tmp_path / "corpus", workspace=tmp_path / "ray", ray="local", workers=2,
                                     batch=4, **tiny(corpus)), QUIET)
    assert grown.entries_written >= 1 and [s.name for s in grown.stages if "ray" in s.name] == \
        ["kv prefix (ray ×1)", "kv fusion (ray ×1)"]


def test_a_ray_build_beside_another_hands_out_its_batches_in_reverse(ray_local, corpus, tmp_path, monkeypatch):
    """Two Ray builds of one workspace at once handed out their batches in the same order, each batch checked
    against the store when it started, so they computed much of the store twice. A build that finds another
    computing KVs (its lock held) hands out the last batch first; what the other stored meanwhile is found, not
    computed, and counted; the store is the one-process build's, byte for byte."""
    from kvf.cachestore import open_store
    from kvf.pipeline.workflows import build as build_module, distributed
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    from kvf.pipeline.workflows.workspace import Workspace
    reference = open_store(str(corpus / "one" / "kv.zarr"))
    plan, sent = [], []
    real_missing_entries, real_fusion_context = build_module.missing_entries, distributed.fusion_context

    def missing_entries(variants, builder, chunks, neighbours, mine):   # the other build, going forward, stores
        todo = real_missing_entries(variants, builder, chunks, neighbours, mine)   # the plan's first half meanwhile
        plan.extend(todo["prefix"])
        for chunk in chunks.chunks(plan[: len(plan) // 2]):
            key = builder.key("prefix", chunk, None)
            builder.store.put(key, reference.get(key), attrs={"variant": "prefix", "chunk_id": chunk.chunk_id})
        return todo

    def fusion_context(variant, batch, neighbours, by_id):   # called on the driver as each batch is sent
        sent.extend(c.chunk_id for c in batch)
        return real_fusion_context(variant, batch, neighbours, by_id)
    monkeypatch.setattr(build_module, "missing_entries", missing_entries)
    monkeypatch.setattr(distributed, "fusion_context", fusion_context)
    (tmp_path / "ws").mkdir()
    with Workspace(tmp_path / "ws").kv_stage_turn() as first:   # held by the other build
        assert first
        summary = build_cache(BuildOptions(corpus=corpus / "data" / "corpus", workspace=tmp_path / "ws", ray="local",
                                           workers=1, batch=4, **{**tiny(corpus), "variants": ("prefix",)}), QUIET)
    stored_meanwhile = len(plan) // 2
    assert len(plan) > 50 and sent == plan[::-1]   # the last batch first: one actor takes them in the order sent
    assert (summary.entries_written, summary.entries_found) == (len(plan) - stored_meanwhile, stored_meanwhile)
    store = open_store(str(tmp_path / "ws" / "kv.zarr"))
    assert len(store.keys()) == len(plan) + 1 and set(store.keys()) <= set(reference.keys())   # and S's entry
    for key in store.keys():
        assert np.array_equal(store.get(key).numpy(), reference.get(key).numpy()), key


def killing_a_worker(args: list[str], markers, poll: float = 0.05):
    """Run `kvf build-cache ... --ray` or `kvf run ... --ray` (args) and SIGKILL the first actor caught mid-task
    (its pid marker in `markers`). Returns (the pid killed or None, the command's exit status, its stderr)."""
    proc = subprocess.Popen(args, env={**ENV, "KVF_RAY_PID_DIR": str(markers)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.time() + 300
    while killed is None and proc.poll() is None and time.time() < deadline:
        for marker in markers.glob("*.pid"):
            try:
                os.kill(int(marker.stem), signal.SIGKILL)
                killed = int(marker.stem)
                break
            except ProcessLookupError:
                continue
        time.sleep(poll)
    _, err = proc.communicate(timeout=600)
    return killed, proc.returncode, err


@pytest.mark.long
def test_worker_killed_mid_batch_is_restarted_and_the_store_is_the_same(embedded_corpus, tmp_path):
    """SIGKILL one actor while it computes a batch: Ray restarts it and retries the batch, which skips
    the entries already committed; the store ends equal to the one-process build, and verifies."""
    markers = tmp_path / "pids"
    markers.mkdir()
    corpus = embedded_corpus
    args = [sys.executable, "-m", "kvf", "build-cache", str(corpus / "data" / "corpus"), "-w", str(tmp_path / "ws"),
            "--chunk-tokens", "32", "--variant", "prefix,fusion", "--neighbours", "2", "--dtype", "float32",
            "--no-bm25", "--ray", "local", "--workers", "2", "--batch", "4"]
    killed, returncode, err = killing_a_worker(args, markers)
    assert killed is not None, "no worker was caught mid-batch"
    assert returncode == 0, err[-2000:]
    assert_same_store(corpus / "one" / "kv.zarr", tmp_path / "ws" / "kv.zarr")


def answers(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {(r["qid"], r["method"], r["settings"]["ratio"]): (r["answer"], r["chunk_ids"],
                                                             {k: v for k, v in r["settings"].items() if k != "store"})
            for r in rows}, len(rows)


@pytest.mark.long
def test_a_run_worker_killed_mid_question_is_restarted_and_the_run_file_is_the_same(embedded_corpus, tmp_path):
    """SIGKILL one actor while it answers a question: Ray restarts it and asks the question again, and the run
    file ends with the one-process run's records, each once (the killed task had written none: records stream
    back to the driver, the file's only writer, when a question is done)."""
    from kvf.pipeline.workflows.run import RunOptions, run
    corpus = embedded_corpus
    shutil.copytree(corpus / "one", tmp_path / "ws")   # the runs may add entries: the build tests' reference stays as built
    common = ["-d", str(corpus / "data"), "-w", str(tmp_path / "ws"), "-m", "full,cacheblend,prophetkv", "-r", "0.15",
              "--max-new-tokens", "4", "--no-warmup", "--no-show-answers"]
    torch.set_num_threads(1)   # the actors run one thread each: same kernels, same bits
    run(RunOptions(out=tmp_path / "one.jsonl", dataset=corpus / "data", workspace=tmp_path / "ws",
                   methods=["full", "cacheblend", "prophetkv"], ratios=[0.15], max_new_tokens=4, warmup=False), QUIET)
    markers = tmp_path / "pids"
    markers.mkdir()
    args = [sys.executable, "-m", "kvf", "run", *common, "-o", str(tmp_path / "ray.jsonl"), "--ray", "local", "--workers", "2"]
    killed, returncode, err = killing_a_worker(args, markers)
    assert killed is not None, "no worker was caught mid-question"
    assert returncode == 0, err[-2000:]
    one, n_one = answers(tmp_path / "one.jsonl")
    on_ray, n_ray = answers(tmp_path / "ray.jsonl")
    assert n_one == n_ray == 9 and on_ray == one


def test_run_on_ray_equals_one_process_run_and_resumes(ray_local, corpus, monkeypatch):
    from kvf.pipeline.workflows import distributed
    from kvf.pipeline.workflows.run import RunOptions, run
    common = dict(methods=["full", "reuse", "cacheblend"], ratios=[0.15], dataset=corpus / "data",
                  workspace=corpus / "one", max_new_tokens=4, warmup=False,
                  model=model_of(corpus))
    run(RunOptions(out=corpus / "one.jsonl", **common), QUIET)
    run(RunOptions(out=corpus / "ray.jsonl", ray="local", workers=2, **common), QUIET)
    one, n_one = answers(corpus / "one.jsonl")
    on_ray, n_ray = answers(corpus / "ray.jsonl")
    assert n_one == n_ray == 9 and one == on_ray
    lines = (corpus / "ray.jsonl").read_text().splitlines(keepends=True)
    (corpus / "ray.jsonl").write_text("".join(lines[:4]))  # a run stopped part-way
    run(RunOptions(out=corpus / "ray.jsonl", ray="local", workers=2, **common), QUIET)
    resumed, n_resumed = answers(corpus / "ray.jsonl")
    assert n_resumed == 9 and resumed == one  # the missing five added, none twice
    with monkeypatch.context() as m:          # finished: resumed again, no actor loads the model for nothing
        m.setattr(distributed, "actor_class", lambda *a: pytest.fail("an actor started with nothing to answer"))
        run(RunOptions(out=corpus / "ray.jsonl", ray="local", workers=2, **common), QUIET)
    assert answers(corpus / "ray.jsonl") == (one, 9)


@pytest.mark.long
def test_an_error_in_a_method_of_ones_own_on_a_worker_is_blamed_on_its_file(corpus, tmp_path):
    """It read "a Ray worker failed: no rows today": the file and line were in the worker's traceback only."""
    write_raising_method(tmp_path / "methods")
    proc = subprocess.run([sys.executable, "-m", "kvf", "run", "-d", corpus / "data", "-w", corpus / "one", "-m", "boom",
                           "-r", "0.5", "-n", "1", "--max-new-tokens", "2", "-o", tmp_path / "o.jsonl", "--ray", "local",
                           "--model", model_of(corpus),
                           "--workers", "1"], capture_output=True, text=True,
                          env={**ENV, "KVF_METHOD_PATH": str(tmp_path / "methods")})
    assert_one_line(proc.returncode, proc.stderr, f"{tmp_path / 'methods' / 'boom.py'} {RAISING_METHOD_ERROR} (run "
                    "without --ray, with --debug, for the traceback)")
    assert proc.returncode == 1


def test_a_ray_run_whose_kvs_its_disk_cannot_hold_is_refused_before_its_workers_start(ray_local, corpus, tmp_path,
                                                                                        monkeypatch):
    """The run's workers compute the stored KVs its questions need; a local store's disk too small for them
    stopped the run with "disk full" part-way. The driver sizes them first, as a one-process run does."""
    from kvf.cachestore import open_store
    from kvf.cachestore.base import KVStore
    from kvf.errors import KvfError
    from kvf.pipeline.workflows import distributed
    from kvf.pipeline.workflows.run import RunOptions, run
    shutil.copytree(corpus / "one", tmp_path / "ws")
    store = open_store(tmp_path / "ws" / "kv.zarr")
    for key in [k for k in store.keys() if store.attrs(k).get("variant") == "fusion"]:
        store.delete(key)
    monkeypatch.setattr(KVStore, "free_bytes", lambda self: 1)
    class WorkersStarted(Exception):
        pass

    def run_with_ray(*args):
        raise WorkersStarted

    monkeypatch.setattr(distributed, "run_with_ray", run_with_ray)
    common = dict(out=tmp_path / "o.jsonl", dataset=corpus / "data", workspace=tmp_path / "ws", ray="local", workers=1,
                  warmup=False, model=model_of(corpus))
    with pytest.raises(KvfError, match=rf"^--store {tmp_path / 'ws' / 'kv.zarr'}: the \d+ entries still to compute for "
                                       "these questions need about .* free space, or pass --store on a larger disk$"):
        run(RunOptions(methods=["fusionrag"], **common), QUIET)
    with pytest.raises(WorkersStarted):   # every prefix entry is there: nothing to size, the workers start
        run(RunOptions(methods=["reuse"], **common), QUIET)


def test_a_worker_that_cannot_load_the_model_is_one_line_naming_why(ray_local, tmp_path):
    """Issue 18's bad input: an actor whose model does not load fails the call with the worker's own one-line
    reason (the flag and the fix), not Ray's traceback."""
    from kvf.errors import KvfError
    from kvf.pipeline.workflows.distributed import KVWorkerImpl, actor_class, task_errors
    from types import SimpleNamespace
    opts = SimpleNamespace(device="cpu", threads=1)                    # what actor_class reads
    worker = actor_class(ray_local, KVWorkerImpl, opts).remote(str(tmp_path / "no-model.gguf"), str(tmp_path / "kv.zarr"),
                                                              "float16", "cpu", (), 1)
    with pytest.raises(KvfError) as raised, task_errors(ray_local):
        ray_local.get(worker.build.remote("prefix", [], None, {}))
    message = str(raised.value)
    assert message.startswith("a Ray worker could not start: ") and "no-model.gguf" in message, message
    assert "\n" not in message and "Traceback" not in message and "\x1b" not in message


def test_a_numbered_gpu_with_ray_is_refused_before_ray_starts(monkeypatch):
    """With --ray, Ray hands each actor one GPU and makes it the only one the actor sees (cuda:0): --device cuda:1
    passed the driver's check on a 2-GPU machine and failed in every actor ('invalid device ordinal')."""
    from types import SimpleNamespace
    from kvf.errors import KvfError
    from kvf.pipeline.workflows import distributed
    monkeypatch.setattr(distributed, "start_ray", lambda *a: pytest.fail("Ray started before the flags were checked"))
    with pytest.raises(KvfError, match=r"^--device cuda:1 with --ray: .*pass --device cuda"):
        distributed.check_ray(SimpleNamespace(ray="local", device="cuda:1", workers=None, threads=1))


def test_a_driver_without_a_gpu_leaves_the_gpu_to_the_workers(ray_local, corpus, tmp_path, capsys, monkeypatch):
    """A Ray cluster's head node often has no GPU. With --ray, --device cuda is the workers' device: the driver
    refused it ('this torch sees no CUDA GPU') however many GPUs the workers had. Now the driver checks its
    spelling, the cluster's room decides (here: none), and each worker checks its own GPU."""
    from kvf.cli.main import main
    from kvf.errors import KvfError
    from kvf.pipeline.workflows.distributed import KVWorkerImpl
    from kvf.pipeline.workflows.devices import driver_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["kvf", "build-cache", str(corpus / "data" / "corpus"), "-w", str(tmp_path / "ws"),
                                      "--ray", "local", "--device", "cuda", "--no-bm25"])
    with pytest.raises(SystemExit):
        main()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the Ray cluster has 0 GPUs" in err and "add GPU nodes or pass --device cpu" in err, err
    assert not (tmp_path / "ws").exists()
    assert driver_device("cuda", "local") == "cpu" and driver_device("cuda", None) == "cuda"
    with pytest.raises(KvfError, match="^--device cuda: this torch sees no CUDA GPU"):   # a worker without one
        KVWorkerImpl(None, str(corpus / "one" / "kv.zarr"), "float32", "cuda", (), 1)


def test_more_workers_than_the_cluster_has_room_for_are_refused_before_any_work(ray_local, corpus, tmp_path):
    """Ray starts an actor only when its CPUs (or GPU) are free, and kvf's actors live until the work is done:
    asking for more than fit used to hang the build forever (measured: --workers 3 on 2 cores). Now it is one
    line naming the flag, the room and the fix, before the workspace is touched."""
    from kvf.errors import KvfError
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    from kvf.pipeline.workflows.distributed import worker_count
    cpus = int(ray_local.cluster_resources()["CPU"])
    assert worker_count(ray_local, None, "cpu", 1) == cpus                 # the default: as many as fit
    assert worker_count(ray_local, None, "cpu", cpus) == 1
    with pytest.raises(KvfError, match=rf"^--workers {cpus + 1}: the Ray cluster has {cpus} CPUs .*room for {cpus}; "
                                       rf"pass --workers {cpus} or fewer"):
        worker_count(ray_local, cpus + 1, "cpu", 1)
    with pytest.raises(KvfError, match="no room for one worker; lower --threads"):
        worker_count(ray_local, None, "cpu", cpus + 1)
    if not ray_local.cluster_resources().get("GPU"):
        with pytest.raises(KvfError, match=r"has 0 GPUs .*add GPU nodes or pass --device cpu"):
            worker_count(ray_local, None, "cuda", 1)
    workspace = tmp_path / "ws"
    with pytest.raises(KvfError, match=rf"^--workers {cpus + 1}: "):
        build_cache(BuildOptions(corpus=corpus / "data" / "corpus", workspace=workspace, ray="local",
                                 workers=cpus + 1, **tiny(corpus)), QUIET)
    assert not workspace.exists()
    from kvf.pipeline.workflows.run import RunOptions, run
    out = tmp_path / "run.jsonl"
    with pytest.raises(KvfError, match=rf"^--workers {cpus + 1}: "):
        run(RunOptions(out=out, methods=["reuse"], dataset=corpus / "data", workspace=corpus / "one", ray="local",
                       workers=cpus + 1, model=model_of(corpus)), QUIET)
    assert not out.exists()



def test_a_run_worker_s_memory_share_is_its_node_s_part():
    """worker_memory_share: a GPU worker takes CACHE_MEMORY_SHARE; a CPU worker that share over the run's workers that
    can sit on its node, at most all of them and at most its CPUs // --threads, at least one."""
    from kvf.pipeline.workflows.distributed import worker_memory_share
    from kvf.pipeline.workflows.run import CACHE_MEMORY_SHARE as share
    assert worker_memory_share("cuda", 8, 1, 64) == share
    assert worker_memory_share("cpu", 2, 1, 2) == share / 2        # this machine: 2 workers, 2 cores
    assert worker_memory_share("cpu", 2, 1, 16) == share / 2       # a big node holds only the run's 2
    assert worker_memory_share("cpu", 64, 1, 16) == share / 16     # 4 nodes of 16: 16 beside each worker, not 64
    assert worker_memory_share("cpu", 64, 4, 16) == share / 4      # 4 threads each: 4 fit a node
    assert worker_memory_share("cpu", 3, 4, 2) == share            # fewer CPUs than --threads: alone


def test_a_workers_failed_store_request_is_named_as_without_ray():
    """A worker's store write that failed (the S3 endpoint went down mid-build) read "a Ray worker failed: Could not
    connect to the endpoint URL ...", with no fix; it is named as the same failure is without --ray."""
    import ray
    from botocore.exceptions import EndpointConnectionError
    from kvf.errors import KvfError
    from kvf.pipeline.workflows.distributed import task_errors
    refused = EndpointConnectionError(endpoint_url="http://10.0.0.5:9000/kvf/ws/zarr.json")
    with pytest.raises(KvfError) as raised, task_errors(ray):
        raise ray.exceptions.RayTaskError("KVWorkerImpl.build", "Traceback (most recent call last): ...", refused)
    assert str(raised.value) == ("a Ray worker's store request failed: cannot reach the object store "
                                 "(EndpointConnectionError: Could not connect to the endpoint URL: "
                                 "\"http://10.0.0.5:9000/kvf/ws/zarr.json\"); check --s3-endpoint (or AWS_ENDPOINT_URL) "
                                 "and that the server is up")

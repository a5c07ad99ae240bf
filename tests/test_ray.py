"""Scale-out on Ray (`--ray local`, two actors on this machine): a distributed build equals a
one-process build byte for byte, also when a worker is killed with SIGKILL mid-batch (its actor is
restarted and the batch retried); `kvf run --ray` writes the same records as a one-process run, and a
resumed distributed run adds only what is missing. Skipped with the reason where Ray is not installed."""
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

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


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A synthetic corpus (55 chunks of 32 tokens) and its one-process build, the reference."""
    from kvf.pipeline.data.synthetic import make_synthetic
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    root = tmp_path_factory.mktemp("ray")
    make_synthetic(root / "data", n_questions=3, passages_per_question=3, seed=1)
    torch.set_num_threads(1)  # the actors run one thread each: same kernels, same bits
    build_cache(BuildOptions(corpus=root / "data" / "corpus", workspace=root / "one", **BUILD), QUIET)
    yield root
    shutil.rmtree(root, ignore_errors=True)


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
                                       workers=2, batch=4, **BUILD), QUIET)
    assert_same_store(corpus / "one" / "kv.zarr", corpus / "ray" / "kv.zarr")
    assert any("ray ×2" in s.name for s in summary.stages)
    manifest = json.loads((corpus / "ray" / "manifest.json").read_text())
    assert manifest["variants"] == ["fusion", "prefix"]
    from kvf.pipeline.workflows import distributed
    with monkeypatch.context() as m:   # resumed with nothing left to do: no actor loads the model for nothing
        m.setattr(distributed, "actor_class", lambda *a: pytest.fail("an actor started with nothing to build"))
        again = build_cache(BuildOptions(corpus=corpus / "data" / "corpus", workspace=corpus / "ray", ray="local",
                                         workers=2, **BUILD), QUIET)
    assert again.entries_written == 0 and not any("ray" in s.name for s in again.stages)
    # a corpus grown by one short document: one batch, so one actor, whatever --workers allows
    shutil.copytree(corpus / "data" / "corpus", tmp_path / "corpus")
    shutil.copytree(corpus / "ray", tmp_path / "ray")
    (tmp_path / "corpus" / "new.txt").write_text("Quorbel Vantrich founded the Drelvan glassworks in 1802.")
    grown = build_cache(BuildOptions(corpus=tmp_path / "corpus", workspace=tmp_path / "ray", ray="local", workers=2,
                                     batch=4, **BUILD), QUIET)
    assert grown.entries_written >= 1 and [s.name for s in grown.stages if "ray" in s.name] == \
        ["kv prefix (ray ×1)", "kv fusion (ray ×1)"]


def build_killing_a_worker(args: list[str], markers, poll: float = 0.05):
    """Run `kvf build-cache ... --ray` (args) and SIGKILL the first actor caught mid-batch (its pid
    marker in `markers`). Returns (the pid killed or None, the build's exit status, its stderr)."""
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


def test_worker_killed_mid_batch_is_restarted_and_the_store_is_the_same(corpus, tmp_path):
    """SIGKILL one actor while it computes a batch: Ray restarts it and retries the batch, which skips
    the entries already committed; the store ends equal to the one-process build, and verifies."""
    markers = tmp_path / "pids"
    markers.mkdir()
    args = [sys.executable, "-m", "kvf", "build-cache", str(corpus / "data" / "corpus"), "-w", str(tmp_path / "ws"),
            "--chunk-tokens", "32", "--variant", "prefix,fusion", "--neighbours", "2", "--dtype", "float32",
            "--no-bm25", "--ray", "local", "--workers", "2", "--batch", "4"]
    killed, returncode, err = build_killing_a_worker(args, markers)
    assert killed is not None, "no worker was caught mid-batch"
    assert returncode == 0, err[-2000:]
    assert_same_store(corpus / "one" / "kv.zarr", tmp_path / "ws" / "kv.zarr")


def answers(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {(r["qid"], r["method"], r["settings"]["ratio"]): (r["answer"], r["chunk_ids"],
                                                             {k: v for k, v in r["settings"].items() if k != "store"})
            for r in rows}, len(rows)


def test_run_on_ray_equals_one_process_run_and_resumes(ray_local, corpus, monkeypatch):
    from kvf.pipeline.workflows import distributed
    from kvf.pipeline.workflows.run import RunOptions, run
    common = dict(methods=["full", "reuse", "cacheblend"], ratios=[0.15], dataset=corpus / "data",
                  workspace=corpus / "one", max_new_tokens=4, warmup=False)
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
                                 workers=cpus + 1, **BUILD), QUIET)
    assert not workspace.exists()
    from kvf.pipeline.workflows.run import RunOptions, run
    out = tmp_path / "run.jsonl"
    with pytest.raises(KvfError, match=rf"^--workers {cpus + 1}: "):
        run(RunOptions(out=out, methods=["reuse"], dataset=corpus / "data", workspace=corpus / "one", ray="local",
                       workers=cpus + 1), QUIET)
    assert not out.exists()


# ---- an existing cluster, as a user starts one --------------------------------------------------------
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head`, as a user starts a cluster, on a machine that has a Ray token in ~/.ray (any local
    `ray.init()`, kvf's `--ray local` included, leaves one there), so Ray turns token auth on; Ray's own temp dir,
    where it leaves the address a later `ray.init()` without one joins; one CPU. Ended with its process group
    (and that address, when it is still this head's). -> (port, the environment of a user on the head)."""
    import secrets
    from ray._common.utils import get_ray_address_file
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {k: v for k, v in ENV.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env["HOME"] = str(home)
    port = free_port()
    head = subprocess.Popen([str(shutil.which("ray", path=os.path.dirname(sys.executable))), "start", "--head",
                             "--block", f"--port={port}", "--num-cpus=1", "--include-dashboard=false"],
                            env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not port_open(port):
            assert head.poll() is None and time.time() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
        time.sleep(2)   # the GCS port opens a moment before the head takes drivers
        yield port, env
    finally:   # SIGKILL: on SIGTERM it tidies its session for half a minute, which nothing here needs
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        address_file = Path(get_ray_address_file(None))
        if address_file.exists() and address_file.read_text().strip().endswith(f":{port}"):
            address_file.unlink()   # left, it would send a later plain ray.init() to a head that is gone


def port_open(port: int) -> bool:
    import socket
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def kvf_run_on(corpus, out, ray: str, env: dict) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "kvf", "run", "-d", str(corpus / "data"), "-w", str(corpus / "one"), "-m", "reuse",
            "-n", "1", "--max-new-tokens", "2", "--no-show-answers", "-o", str(out), "--ray", ray, "--workers", "1"]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvf: error: "), err[-3000:]
    return lines[0]


def test_a_cluster_started_with_ray_start_is_reached_with_its_token_and_local_starts_its_own(ray_head, corpus,
                                                                                          tmp_path):
    """A head from `ray start --head` wants the token it keeps in ~/.ray: kvf's driver never sent it (20 refused
    tries on stderr, then "Failed to connect"). Without the token it is one line naming the token and where
    it goes. And `--ray local` beside that cluster starts an instance of its own: Ray's default joined the
    cluster it found and refused kvf's CPU count ("pass --ray local", said to --ray local)."""
    port, env = ray_head
    joined = kvf_run_on(corpus, tmp_path / "joined.jsonl", f"127.0.0.1:{port}", env)
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert len((tmp_path / "joined.jsonl").read_text().splitlines()) == 1
    (tmp_path / "elsewhere").mkdir()
    no_token = kvf_run_on(corpus, tmp_path / "no-token.jsonl", f"127.0.0.1:{port}", {**env, "HOME": str(tmp_path / "elsewhere")})
    line = one_line(no_token.stderr)
    assert f"--ray 127.0.0.1:{port}: cannot connect" in line and "token" in line and "RAY_AUTH_TOKEN" in line, line
    own = subprocess.run([sys.executable, "-c", "import os; from kvf.pipeline.workflows.distributed import start_ray; "
                          "print(int(start_ray('local').cluster_resources()['CPU']), os.cpu_count())"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr[-3000:]
    cpus, machine = own.stdout.split()
    assert cpus == machine   # the head has 1 CPU: an instance of its own has the machine's


def test_a_port_that_is_not_a_ray_head_is_one_line_soon(tmp_path):
    """A port that takes connections but is no Ray head (the dashboard's, a client port without ray://): Ray's
    driver tried for over 5 minutes, a few lines on stderr each try. Now one try, and one line. (Ray's own
    timeouts are shortened here so the test is short; kvf's setting of one try is what is tested.)"""
    import socket
    import threading
    server = socket.socket()
    server.bind(("0.0.0.0", 0))   # Ray asks for the machine's address in place of 127.0.0.1
    server.listen(64)
    port = server.getsockname()[1]

    def refuse():
        while True:
            try:
                server.accept()[0].close()
            except OSError:
                return
    threading.Thread(target=refuse, daemon=True).start()
    env = {**ENV, "RAY_py_gcs_connect_timeout_s": "2", "RAY_gcs_rpc_server_connect_timeout_s": "1"}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "kvf", "run", "-q", str(tmp_path / "q.jsonl"), "-m", "reuse",  # not read:
                                                                                                       # --ray comes first
                           "-o", str(tmp_path / "o.jsonl"), "--ray", f"127.0.0.1:{port}"],
                          env=env, capture_output=True, text=True, timeout=240)
    server.close()
    line = one_line(proc.stderr)
    assert f"--ray 127.0.0.1:{port}: cannot connect to a Ray cluster there" in line, line
    assert time.time() - started < 120

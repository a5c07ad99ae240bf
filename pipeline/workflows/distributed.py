"""Ray as kvf's distributed engine (`kvf build-cache --ray`, `kvf run --ray`; `pip install 'kvf[ray]'`).

- build-cache: chunking and indexing stay on the driver; chunk KVs are computed by Ray actors, one
  model per actor, in batches of chunks, each actor writing straight into the shared store (a local
  path, a shared filesystem or s3://). S's entry is stored first, by one actor (the driver never loads
  the model, so it holds no GPU memory an actor needs), and `prefix` entries before `fusion` ones (a
  fusion entry reads its neighbours' prefix entries), so no two actors of one build write the same key at the
  same time. A local store commits entries atomically anyway; an object
  store commits by marker, so the ordering is what keeps it correct there.
- run: questions are spread over actors, each with its own model and store reader; every record
  comes back to the driver, the only writer of the run file (resumable, no duplicates, no torn lines).
- Actors are restarted and their in-flight task retried when a worker dies (kill -9 included):
  entries are content-addressed and a retried batch skips what was committed, so the store ends
  the same as a one-process build.
- Two builds of one workspace at once (a second terminal; with --ray or without) hand out their batches
  in opposite orders, and an actor asks the store which of its batch's entries are still missing when
  the batch starts: the builds meet in the middle instead of computing every entry twice.
With no address, a local Ray instance sized to the machine is started.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from kvf.errors import KvfError

WORKER_ENV = ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "KVF_CACHE", "KVF_DATA", "AWS_ACCESS_KEY_ID",
              "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL",
              "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CA_BUNDLE", "KVF_METHOD_PATH",
              "KVF_RAY_PID_DIR", "TQDM_DISABLE")


def start_ray(address: str | None, threads: int = 1):
    """ray, initialised: connected to `address`, or a local instance sized to the machine."""
    try:
        import ray
    except ImportError:
        raise KvfError("--ray needs Ray: pip install 'kvf[ray]'") from None
    env = {k: os.environ[k] for k in WORKER_ENV if k in os.environ}
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_DISABLE_PROGRESS_BARS="1")
    if ray.is_initialized():
        return ray
    check_ray_address(address)
    try:
        if address in (None, "", "local"):
            # Ray runs workers at nice 15 so its own daemons win the CPU; here the workers ARE the work, and
            # at nice 15 any other process on the machine starves them (measured: 15x slower prefill)
            os.environ.setdefault("RAY_worker_niceness", "0")
            # Ray's notice that a new local cluster has token auth on (its default, kept) would be a second
            # stderr line on every run beside kvf's own
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
            # address "local" starts an instance of our own: with none, Ray joins a `ray start` cluster it finds
            # on the machine, and refused our num_cpus there
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": env}, configure_logging=False)
        else:
            connect_to_cluster(ray, address, env)
    except KvfError:
        raise
    except Exception as e:  # ConnectionError, RuntimeError, ValueError... for a bad or unreachable address
        raise cannot_connect(address, str(e).splitlines()[0][:120]) from None
    return ray


def cannot_connect(address: str, reason: str) -> KvfError:
    if "token" in reason.lower():   # Ray's token auth: a `ray start --head` turns it on when the machine holds a token
        fix = ("give kvf the cluster's token: RAY_AUTH_TOKEN, or ~/.ray/auth_token as on the head (`ray get-auth-token` "
               "there prints it)")
    else:
        fix = ("check the address (`ray status` on the head node: the GCS port, 6379 unless set; a Ray client's is "
               "ray://HOST:10001) or pass --ray local")
    return KvfError(f"--ray {address}: cannot connect to a Ray cluster there ({reason}); {fix}")


# A port that accepts connections but is not a Ray head (the dashboard's, a client port without ray://) kept
# Ray's driver trying for over 5 minutes, each try a few lines on stderr from its C++ client (Ray 2.60: 20
# tries, 41 s each measured here). One try, with 10 s for the head to answer, ends it in well under a minute
# (44 s measured, the suite running beside it); a head answers in milliseconds. Environment variables of the
# same names, when set, win.
RAY_CONNECT_SETTINGS = {"RAY_gcs_server_port_wait_time_s": "1", "RAY_py_gcs_connect_timeout_s": "10"}


def connect_to_cluster(ray, address: str, env: dict) -> None:
    """ray.init against an existing cluster: tried once, with what Ray's C++ client says while it tries
    kept off stderr (replayed if it connects), so a failure is kvf's one line, with Ray's reason in it."""
    for name, value in RAY_CONNECT_SETTINGS.items():
        os.environ.setdefault(name, value)
    send_token_if_any()
    failed = None
    with stderr_captured() as said:
        try:
            ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": env}, configure_logging=False)
        except Exception as e:   # ConnectionError, RuntimeError, ValueError...
            failed = e
    if failed is None:
        sys.stderr.write(said())
        return
    raise cannot_connect(address, ray_said_why(said()) or str(failed).splitlines()[0][:120])


def send_token_if_any() -> None:
    """A head started by `ray start --head` on a machine that holds a token (any local ray.init() leaves one in
    ~/.ray) wants it, and ray.init(address=...) sends the one it has (~/.ray/auth_token, RAY_AUTH_TOKEN) only
    with RAY_AUTH_MODE=token: without it every try was refused, 20 lines on stderr, then "Failed to connect".
    A RAY_AUTH_MODE the user set is kept."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:   # a Ray without token auth
        return
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


GCS_FAILED = "Failed to get cluster ID from GCS server: "


def ray_said_why(stderr: str) -> str | None:
    """The last reason Ray's C++ client gave for a failed try: its last clause where that is a sentence
    ('Authentication token is missing or incorrect' from '... GCS server: Unauthenticated: RPC error: ...:
    <reason>'), else the whole of it less the error's class: a port that answers HTTP but is not Ray's ends
    '... status: 404 rpc_code: 12', whose last clause alone said "(12)"."""
    tries = [line.split(GCS_FAILED, 1)[1].strip() for line in stderr.splitlines() if GCS_FAILED in line]
    if not tries:
        return None
    last = tries[-1].rsplit(": ", 1)[-1]
    if len(last.split()) >= 3:
        return last
    return tries[-1].removeprefix("RpcError: ").removeprefix("RPC error: ")[:120]


@contextmanager
def stderr_captured():
    """File descriptor 2 into a temporary file for the block (C++ code writes there, past sys.stderr);
    yields a function returning what was written, once the block has ended."""
    sys.stderr.flush()
    saved, written = os.dup(2), []
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield lambda: "".join(written)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            written.append(capture.read().decode(errors="replace"))


def check_ray(opts) -> None:
    """Before any work: the address answers, and the cluster has room for the workers asked for (Ray
    would otherwise wait forever for the rest). Starts Ray; later start_ray calls find it started."""
    check_ray_address(opts.ray)
    check_worker_flags(opts.workers, opts.threads)   # before Ray starts: a bad flag costs no seconds
    if opts.device.startswith("cuda:"):   # each actor sees only the GPU Ray gave it, as cuda:0
        raise KvfError(f"--device {opts.device} with --ray: Ray gives each worker a GPU of its own, which it sees as "
                       "cuda; pass --device cuda (CUDA_VISIBLE_DEVICES on the nodes picks which GPUs Ray uses)")
    worker_count(start_ray(opts.ray, opts.threads), opts.workers, opts.device, opts.threads)


def check_ray_address(address: str | None, timeout: float = 5.0) -> None:
    """Checked before any work starts. Ray retries an unreachable head for minutes: try its port once
    first, and say so in one line."""
    import socket
    if address in (None, "", "local", "auto"):
        return
    if address.lstrip("-").isdigit():   # a worker count where the address goes
        workers = address if address.isdigit() and int(address) >= 1 else "N"
        raise KvfError(f"--ray {address}: --ray takes where Ray runs, not how many workers; for {workers} workers "
                       f"here pass --ray local --workers {workers}" + (" (N at least 1)" if workers == "N" else ""))
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise KvfError(f"--ray {address}: expected local, auto, HOST:PORT (the head's GCS port, 6379) or "
                       "ray://HOST:PORT (Ray client, 10001)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise KvfError(f"--ray {address}: cannot reach a Ray head there ({e.strerror or e}); start one with "
                       "`ray start --head`, check the address, or pass --ray local") from None


def worker_count(ray, workers: int | None, device: str, threads: int) -> int:
    """--workers, or as many as the cluster has room for: one GPU per worker with --device cuda, else
    --threads CPUs. More than fit is refused: Ray would start the rest only when others end, and kvf's
    workers live until the work is done, so their tasks would wait forever. Flags checked by check_ray."""
    gpu = device.startswith("cuda")
    have = int(ray.cluster_resources().get("GPU" if gpu else "CPU", 0))
    room = have if gpu else have // threads                       # what actor_class asks of each worker
    what = f"{have} GPUs (one per worker with --device {device})" if gpu else f"{have} CPUs ({threads} per worker, --threads)"
    if room < 1:
        fix = "add GPU nodes or pass --device cpu" if gpu else "lower --threads or add nodes"
        raise KvfError(f"--ray: the Ray cluster has {what}: no room for one worker; {fix}")
    if workers is not None and workers > room:
        raise KvfError(f"--workers {workers}: the Ray cluster has {what}, room for {room}; "
                       f"pass --workers {room} or fewer, or add nodes")
    return workers or room


def check_worker_flags(workers: int | None, threads: int) -> None:
    if workers is not None and workers < 1:
        raise KvfError(f"--workers {workers}: must be >= 1")
    if threads < 1:
        raise KvfError(f"--threads {threads}: must be >= 1")


def write_pid_marker() -> None:
    """For tests that kill a worker mid-task: each batch announces its process while it runs."""
    directory = os.environ.get("KVF_RAY_PID_DIR")
    if directory:
        with open(os.path.join(directory, f"{os.getpid()}.pid"), "w") as f:
            f.write(str(os.getpid()))


def clear_pid_marker() -> None:
    directory = os.environ.get("KVF_RAY_PID_DIR")
    if directory:
        try:
            os.unlink(os.path.join(directory, f"{os.getpid()}.pid"))
        except FileNotFoundError:
            pass


# ---- build-cache ---------------------------------------------------------------------------------
class KVWorkerImpl:
    """One model and one store writer; builds the KV entries of batches of chunks."""

    def __init__(self, model: str | None, store: str, dtype: str, device: str, extras_for: tuple, threads: int,
                 model_dtype: str | None = None, s3_endpoint: str | None = None):
        import torch
        if s3_endpoint:   # the driver's, which it may have read from the workspace after Ray took its environment
            os.environ["AWS_ENDPOINT_URL"] = s3_endpoint
        from kvf.pipeline.workflows.build import EntryBuilder, open_workspace_store
        from kvf.pipeline.workflows.devices import check_device, compute_dtype
        from kvf.pipeline.workflows.weights import open_model
        from kvf.pipeline.workflows.workspace import Workspace
        check_device(device)   # this worker's own GPU: the driver (perhaps a CPU head node) did not check it
        torch.set_num_threads(threads)
        model_ref = open_model(model)
        opened = open_workspace_store(Workspace("."), model_ref, store, None, dtype, create=False)
        self.builder = EntryBuilder(model_ref, opened, device, extras_for, dtype=compute_dtype(device, model_dtype))

    def system(self) -> None:
        """S's entry, computed and stored unless present: by one actor, before any batch (every chunk attends to it)."""
        self.builder.system_kv()

    def build(self, variant: str, chunks: list, neighbours: dict | None, by_id: dict) -> dict:
        import time
        write_pid_marker()
        started = time.perf_counter()
        entries, nbytes, found = self.builder.entries_written, self.builder.bytes_written, self.builder.entries_found
        missing = self.builder.missing(variant, chunks, neighbours)   # a retried batch skips what is done
        with self.builder.writing_behind():
            for chunk in missing:
                self.builder.compute(variant, chunk, neighbours, by_id)
        clear_pid_marker()
        return {"chunks": len(chunks), "entries_written": self.builder.entries_written - entries,
                "bytes_written": self.builder.bytes_written - nbytes,
                "entries_found": len(chunks) - len(missing) + self.builder.entries_found - found,
                "seconds": time.perf_counter() - started}


@functools.lru_cache(maxsize=None)
def remote_class(impl: type):
    import ray
    return ray.remote(max_restarts=3, max_task_retries=3)(impl)


def build_kv_with_ray(opts, builder, chunks, neighbours: Mapping | None, console, summary,
                      todo: dict[str, list[str]], first: bool = True) -> list:
    """The KV stage of build-cache on Ray actors (see the module docstring); `todo`: build.missing_entries, handed
    out in reverse when another build computes KVs into this workspace now (`first` False; see build.stage_kv).
    Returns StageStats. Actors (a model load each) start only for work that is missing, and no more than its batches."""
    from ray.util import ActorPool
    from kvf.pipeline.workflows.build import StageStat, kv_stage_note
    ray = start_ray(opts.ray, opts.threads)
    n_batches = max(-(-len(missing) // opts.batch) for missing in todo.values())
    n_workers = min(worker_count(ray, opts.workers, opts.device, opts.threads), n_batches)
    if n_workers == 0:   # a resumed or grown-by-nothing build: no actor loads the model for nothing
        return [StageStat(f"kv {variant}", 0, 0, 0.0, kv_stage_note(variant, opts.variants, [])) for variant in todo]
    model = str(absolute(opts.model)) if opts.model else None
    workers = [actor_class(ray, KVWorkerImpl, opts).remote(model, store_address(builder.store), builder.store.dtype,
                                                           opts.device, tuple(m.name for m in builder.extras_methods), opts.threads,
                                                           opts.compute_dtype, os.environ.get("AWS_ENDPOINT_URL"))
               for _ in range(n_workers)]
    try:
        with task_errors(ray):
            ray.get(workers[0].system.remote())   # S once, before any batch: the actors only read it after
        stats = build_batches(opts, ActorPool(workers), n_workers, todo, chunks, neighbours, console, summary, ray,
                              first)
    finally:
        for w in workers:
            ray.kill(w)
    return stats


def build_batches(opts, pool, n_workers: int, todo: dict[str, list[str]], chunks, neighbours: Mapping | None, console,
                  summary, ray, first: bool = True) -> list:
    """Each variant's missing entries, in batches of --batch chunks, over the actor pool (the last batch first
    when `first` is False). A batch's chunks become Chunk objects as it is sent; its actor asks the store which
    are still missing when it starts, so two builds at once meet in the middle."""
    import time
    from kvf.pipeline.workflows.build import StageStat, kv_stage_note, stage
    stats = []
    for variant, missing in todo.items():
        stat = StageStat(f"kv {variant} (ray ×{n_workers})", len(missing), chunks.tokens(missing))
        started = time.perf_counter()
        order = missing if first else missing[::-1]
        batches = [order[i: i + opts.batch] for i in range(0, len(order), opts.batch)]

        def submit(worker, ids, variant=variant):
            batch = list(chunks.chunks(ids))
            return worker.build.remote(variant, batch, *fusion_context(variant, batch, neighbours, chunks))

        with stage(console, f"KV {variant} on {n_workers} Ray workers", len(missing)) as advance, task_errors(ray):
            for result in pool.map_unordered(submit, batches):
                advance(result["chunks"])
                summary.entries_written += result["entries_written"]
                summary.bytes_written += result["bytes_written"]
                summary.entries_found += result["entries_found"]
        stat.seconds = time.perf_counter() - started
        stat.note = kv_stage_note(variant, opts.variants, missing)
        stats.append(stat)
    return stats


def fusion_context(variant: str, batch: list, neighbours: Mapping | None, by_id) -> tuple[dict | None, dict]:
    """(neighbours, chunks by id) of just this batch: what its fusion entries attend to. A task carries
    these, not the corpus-wide tables."""
    if variant != "fusion":
        return None, {}
    mine = {c.chunk_id: neighbours.get(c.chunk_id, []) for c in batch}
    return mine, {nid: by_id[nid] for ids in mine.values() for nid in ids} | {c.chunk_id: c for c in batch}


# ---- run -------------------------------------------------------------------------------------------
class RunWorkerImpl:
    """One session (model + store reader) answering whole questions with every planned method."""

    def __init__(self, opts, setting: str, name: str, workspace: str, n_workers: int):
        import torch
        from kvf.pipeline.workflows.run import (ChunkPicker, QuestionRunner, base_settings, plan_methods,
                                                settings_for)
        from kvf.pipeline.workflows.session import Session
        from kvf.pipeline.workflows.workspace import Workspace
        torch.set_num_threads(opts.threads)
        ws = Workspace(Path(workspace))
        self.planned = plan_methods(opts)  # the driver's plan: same options, same order
        extras_for = {p.method.name for p in self.planned if p.method.extras_hook is not None}
        session = Session(ws, opts.model, opts.device, opts.dtype, opts.store, tuple(extras_for))
        settings_of = settings_for(self.planned, opts, base_settings(opts, setting, session.manifest,
                                                                     session.model_ref.name, session.dtype))
        memory_share = worker_memory_share(opts.device, n_workers, opts.threads, node_cpus())   # here, where it runs
        self.runner = QuestionRunner(opts, session, ChunkPicker(ws, setting, opts.top_k, opts.retriever),
                                     self.planned, settings_of, name, memory_share)

    def answer(self, question, indices: list[int]) -> list[dict]:
        write_pid_marker()
        records = list(self.runner.records(question, [self.planned[i] for i in indices]))
        clear_pid_marker()
        return records


def worker_memory_share(device: str, n_workers: int, threads: int, cpus_here: float) -> float:
    """The share of the free memory a run worker's prefilled caches may take (run.CACHE_MEMORY_SHARE, which one process
    takes alone). A GPU worker has its GPU to itself. CPU workers share their node's memory with the run's other
    workers there: at most all n_workers of them, and at most as many as the node's CPUs hold at `threads` each.
    Worked out where the worker runs, so that one restarted on another node takes that node's part."""
    from kvf.pipeline.workflows.run import CACHE_MEMORY_SHARE
    if device.startswith("cuda"):
        return CACHE_MEMORY_SHARE
    return CACHE_MEMORY_SHARE / max(1, min(n_workers, int(cpus_here // threads)))


def node_cpus() -> float:
    """The CPUs Ray counts on the node this process runs on (os.cpu_count() where Ray cannot say: not in Ray)."""
    import ray
    if ray.is_initialized():
        me = ray.get_runtime_context().get_node_id()
        cpus = next((n["Resources"].get("CPU") for n in ray.nodes() if n["NodeID"] == me and n["Alive"]), None)
        if cpus:
            return cpus
    return os.cpu_count() or 1


def run_with_ray(opts, jobs: list, setting: str, name: str, workspace: Path, write) -> None:
    """Answer (question, planned indices) jobs on Ray actors; write(record dict) runs on the driver,
    the only writer of the run file."""
    from ray.util import ActorPool
    if not jobs:   # a finished run resumed: no actor loads the model for nothing
        return
    ray = start_ray(opts.ray, opts.threads)
    n_workers = min(worker_count(ray, opts.workers, opts.device, opts.threads), len(jobs))
    worker_opts = replace(opts, ray=None, **{f: absolute(getattr(opts, f)) for f in ("dataset", "questions", "workspace", "out")})
    workers = [actor_class(ray, RunWorkerImpl, opts).remote(worker_opts, setting, name, str(Path(workspace).resolve()),
                                                            n_workers)
               for _ in range(n_workers)]
    try:
        with task_errors(ray):
            for records in ActorPool(workers).map_unordered(lambda w, job: w.answer.remote(*job), jobs):
                for rec in records:
                    write(rec)
    finally:
        for w in workers:
            ray.kill(w)


# ---- shared ----------------------------------------------------------------------------------------
def absolute(path):
    """Paths sent to workers are absolute: a worker's working directory is not the driver's."""
    return None if path is None else Path(path).resolve()


def store_address(store) -> str:
    return str(Path(store.root).resolve()) if store.fs.local else store.path


def actor_class(ray, impl: type, opts):
    """impl as a Ray actor: restarted (and its in-flight task retried) when its process dies; one
    GPU per actor with --device cuda, else opts.threads CPUs."""
    gpu = 1 if opts.device.startswith("cuda") else 0
    return remote_class(impl).options(num_cpus=0 if gpu else opts.threads, num_gpus=gpu)


@contextmanager
def task_errors(ray):
    """A KvfError raised in a worker is re-raised here as itself (one line); a worker that keeps dying
    is one line too."""
    from kvf.cachestore import remote_failure
    from kvf.pipeline.fusion.methods.base import user_method_error
    try:
        yield
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, KvfError):
            raise KvfError(str(cause)) from None
        blamed = user_method_error(cause, str(e)) if cause is not None else None
        if blamed is not None:   # a $KVF_METHOD_PATH method raised on the worker: the user's code, not Ray's
            raise KvfError(f"{blamed} (run without --ray, with --debug, for the traceback)") from None
        said = remote_failure(cause) if cause is not None else None
        if said:   # the store's endpoint went down, its credentials expired: as without --ray
            raise KvfError(f"a Ray worker's store request failed: {said}") from None
        raise KvfError(f"a Ray worker failed: {str(cause or e).strip().splitlines()[-1][:200]}") from None
    except ray.exceptions.RayActorError as e:
        if getattr(e, "actor_init_failed", False):   # its __init__ raised (e.g. it cannot load the model): say why
            raise KvfError(f"a Ray worker could not start: {creation_error(str(e))}") from None
        raise KvfError(f"a Ray worker died and could not be restarted ({str(e).strip().splitlines()[0][:160]}); "
                       "see `ray logs` or run without --ray") from None


def creation_error(text: str) -> str:
    """Ray's text for an actor whose __init__ raised -> that exception's own last line, a KvfError's message
    as it is (it names the flag and the fix), any other as 'Type: message'."""
    last = text.strip().splitlines()[-1].strip()
    prefix = f"{KvfError.__module__}.{KvfError.__qualname__}: "
    return last[len(prefix):] if last.startswith(prefix) else last[:200]

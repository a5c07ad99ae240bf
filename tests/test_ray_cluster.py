"""`--ray HOST:PORT` against a cluster as users start one (`ray start --head`), and against a port that is no
Ray head: joined with the machine's Ray token, one line without it, one line soon for a wrong port, and
`--ray local` beside such a cluster starting an instance of its own. A file of its own so that pytest-xdist runs
it beside tests/test_ray.py. Skipped with the reason where Ray is not installed."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_one_line

from kvf.scripts.s3_local import free_port

pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvf[ray]')")

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


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


def kvf_run_on(built, out, ray: str, env: dict) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "kvf", "run", "-d", str(built / "data"), "-w", str(built / "ws"), "-m", "reuse",
            "-n", "1", "--max-new-tokens", "2", "--no-show-answers", "-o", str(out), "--ray", ray, "--workers", "1"]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.long
def test_a_cluster_started_with_ray_start_is_reached_with_its_token_and_local_starts_its_own(ray_head, built,
                                                                                          tmp_path):
    """A head from `ray start --head` wants the token it keeps in ~/.ray: kvf's driver never sent it (20 refused
    tries on stderr, then "Failed to connect"). Without the token it is one line naming the token and where
    it goes. And `--ray local` beside that cluster starts an instance of its own: Ray's default joined the
    cluster it found and refused kvf's CPU count ("pass --ray local", said to --ray local)."""
    port, env = ray_head
    joined = kvf_run_on(built, tmp_path / "joined.jsonl", f"127.0.0.1:{port}", env)
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert len((tmp_path / "joined.jsonl").read_text().splitlines()) == 1
    (tmp_path / "elsewhere").mkdir()
    no_token = kvf_run_on(built, tmp_path / "no-token.jsonl", f"127.0.0.1:{port}", {**env, "HOME": str(tmp_path / "elsewhere")})
    assert_one_line(no_token.returncode, no_token.stderr, f"kvf: error: --ray 127.0.0.1:{port}: cannot connect", "token",
                    "RAY_AUTH_TOKEN")
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
    assert_one_line(proc.returncode, proc.stderr, f"kvf: error: --ray 127.0.0.1:{port}: cannot connect to a Ray cluster there")
    assert time.time() - started < 120


def test_ray_s_reason_is_its_sentence_or_its_whole_clause():
    """`--ray 10.0.0.1:6379` reached a server that answers HTTP/2 but is not Ray's: the line said "cannot connect
    to a Ray cluster there (12)", the last clause of Ray's reason alone. A reason whose last clause is a sentence
    (a wrong token) is still that sentence."""
    from kvf.pipeline.workflows.distributed import ray_said_why
    said = ("[2026-12-07 06:49:30,529 W 359 359] gcs_client.cc:210: Failed to get cluster ID from GCS server: RpcError: "
            "RPC error: Received http2 header with status: 404 rpc_code: 12\n")   # as Ray 2.x wrote it, captured
    assert ray_said_why(said) == "Received http2 header with status: 404 rpc_code: 12"
    said = ("[...] gcs_client.cc:210: Failed to get cluster ID from GCS server: Unauthenticated: RPC error: "
            "Unauthenticated: Authentication token is missing or incorrect\n")
    assert ray_said_why("x\n" + said * 2) == "Authentication token is missing or incorrect"
    assert ray_said_why("nothing of Ray's\n") is None


@pytest.mark.long
def test_each_run_worker_takes_its_own_node_s_part_of_the_memory():
    """A CPU run worker's caches may take CACHE_MEMORY_SHARE / (the run's workers that can sit on its node): on a
    two-node cluster (1 and 3 CPUs, as ray.cluster_utils starts one on this machine) a worker on each node, worked out
    where it runs, takes that node's part. Dividing by every worker of the run (v1 of this) took a quarter on each."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvf.pipeline.workflows.distributed import node_cpus, worker_memory_share
    from kvf.pipeline.workflows.run import CACHE_MEMORY_SHARE
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=3)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()

        @ray.remote(num_cpus=1)
        def share_here():
            return node_cpus(), worker_memory_share("cpu", 4, 1, node_cpus())
        got = sorted(ray.get(share_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                             .remote()) for n in ray.nodes() if n["Alive"])
        assert got == [(1.0, CACHE_MEMORY_SHARE), (3.0, CACHE_MEMORY_SHARE / 3)], got
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_clusters_workers_are_sent_the_s3_settings_the_driver_has(monkeypatch):
    """A cluster's workers see only the environment kvf sends them (runtime_env). The CA bundle of an https store
    whose certificate signs itself (AWS_CA_BUNDLE, which kvf's own line names as the fix) was not sent: the driver
    reached the store, and every worker was refused."""
    import ray
    from kvf.pipeline.workflows import distributed
    settings = {"AWS_ENDPOINT_URL": "https://minio.lab:9000", "AWS_CA_BUNDLE": "/etc/lab-ca.pem",
                "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret"}
    for name, value in {**settings, "RAY_worker_niceness": "0"}.items():   # the last: start_ray sets it when unset
        monkeypatch.setenv(name, value)
    sent = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: sent.update(kw["runtime_env"]["env_vars"]))
    distributed.start_ray("local")
    assert {name: sent.get(name) for name in settings} == settings

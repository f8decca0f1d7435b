"""Real clusters: `dask scheduler` and `dask worker` as separate processes over TLS, and a local
machine that listens on 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from taskrt import models
from taskrt.graph.config import ParallelConfig as P
from taskrt.graph.strategy import Strategy
from taskrt.machines.calibration import cpu_costs
from taskrt.machines.machine import Machine
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer


def _listening(dask_worker=None, dask_scheduler=None):
    """(host, port) of every socket this process listens on."""
    import psutil

    return sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN})


def _servers(dask_worker=None, dask_scheduler=None):
    """Hosts the Dask server of this process (scheduler or worker) listens on: its comm listeners
    and its HTTP server (the dashboard)."""
    server = dask_worker or dask_scheduler
    hosts = [listener.listen_address for listener in server.listeners]
    http = getattr(server, "http_server", None)
    if http is not None:
        hosts += [sock.getsockname()[0] for sock in http._sockets.values()]
    return hosts


def test_local_machine_binds_everything_to_loopback():
    with Machine.local(2, probe=False) as machine:
        client = machine.client
        assert client.scheduler.address.startswith("tcp://127.0.0.1:")
        assert client.dashboard_link.startswith("http://127.0.0.1:")
        scheduler = client.run_on_scheduler(_servers)
        assert scheduler and all("127.0.0.1" in host for host in scheduler), scheduler
        for address, hosts in client.run(_servers).items():
            assert address.startswith("tcp://127.0.0.1:")
            assert hosts and all("127.0.0.1" in host for host in hosts), (address, hosts)
        # every socket the worker processes listen on (worker comms, worker dashboards, ...)
        for address, sockets in client.run(_listening).items():
            assert sockets and all(ip == "127.0.0.1" for ip, _ in sockets), (address, sockets)
        # nannies run in this process beside the scheduler
        for nanny in machine.cluster.workers.values():
            assert all("127.0.0.1" in listener.listen_address for listener in nanny.listeners)


def _write_throwaway_certificate(folder):
    """A self-signed key and certificate for every role (distributed.Security.temporary), as files."""
    from distributed import Security

    temporary = Security.temporary()
    (folder / "cert.pem").write_text(temporary.tls_ca_file)
    (folder / "key.pem").write_text(temporary.tls_client_key)
    return folder / "cert.pem", folder / "key.pem"


def _wait_for(path, process, timeout=300):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"{process.args} exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


@pytest.mark.timeout(900)
@pytest.mark.slow  # starts `dask scheduler` and two `dask worker` processes
def test_a_step_over_tls_on_separately_started_scheduler_and_workers(tmp_path):
    pytest.importorskip("cryptography")
    from distributed import Client, Security

    cert, key = _write_throwaway_certificate(tmp_path)
    tls = ["--tls-ca-file", str(cert), "--tls-cert", str(cert), "--tls-key", str(key)]
    dask = [sys.executable, "-m", "dask"]  # the `dask` command of this environment
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False"}
    scheduler_file = tmp_path / "scheduler.json"
    processes = [subprocess.Popen(
        [*dask, "scheduler", "--protocol", "tls", "--host", "127.0.0.1", "--port", "0",
         "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file),
         "--preload", "taskrt.dashboard", *tls],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_for(scheduler_file, processes[0])
        address = json.loads(scheduler_file.read_text())["address"]
        assert address.startswith("tls://127.0.0.1:")
        for i in range(2):
            processes.append(subprocess.Popen(
                [*dask, "worker", address, "--nthreads", "1", "--nworkers", "1", "--host", "127.0.0.1",
                 "--dashboard-address", "127.0.0.1:0", "--resources", f"dev{i}=1", *tls],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        security = Security(tls_ca_file=str(cert), tls_client_cert=str(cert), tls_client_key=str(key),
                            require_encryption=True)
        with Client(address, security=security, timeout="60s") as client:
            client.wait_for_workers(2, timeout=300)
            assert all(w.startswith("tls://") for w in client.scheduler_info()["workers"])
            machine = Machine.from_client(client, probe=False)
            graph = models.lenet5(batch=4, image_size=16, width=0.5)
            strategy = Strategy({l.name: P(n=2, devices=(1, 0)) for l in graph if not l.is_input})
            trainer = Trainer(graph, strategy, machine, dtype="float64")
            rng = np.random.default_rng(0)
            x, y = rng.standard_normal(graph.inputs[0].shape), rng.integers(0, 10, 4)
            assert trainer.step(x, y) == pytest.approx(SingleDeviceTrainer(graph, dtype="float64").step(x, y),
                                                       rel=1e-12)
            assert trainer.stats.measured_bytes == trainer.stats.planned_bytes
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def test_local_machines_shorten_message_batching_and_given_clusters_keep_theirs(machine4):
    """taskrt.machines.batching: every stream of a cluster Machine.local started sends after at most
    INTERVAL_S; a cluster given to Machine.from_client keeps Dask's own intervals."""
    from distributed import Client, LocalCluster

    from taskrt.machines.batching import INTERVAL_S, intervals

    ours = intervals(machine4.client)
    assert ours["client"] == INTERVAL_S and len(ours["workers"]) == 4
    assert set(ours["workers"].values()) == {INTERVAL_S} and set(ours["scheduler"]) == {INTERVAL_S}
    assert len(ours["scheduler"]) >= 5  # to each of the 4 workers, and to this client
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        Machine.from_client(client, probe=False)
        theirs = intervals(client)
        assert theirs["client"] > INTERVAL_S and min(theirs["workers"].values()) > INTERVAL_S
        assert min(theirs["scheduler"]) > INTERVAL_S


def test_the_runtimes_processor_time_per_byte_counts_moving_bytes_and_leaves_nothing(machine4):
    # 16 MiB messages: their processor time well above what the idle workers spend meanwhile
    costs = cpu_costs(machine4, tasks=50, nbytes=16 * 2**20, messages=2, small=20)
    assert costs["cpu_per_task_s"] > 0 and 0 <= costs["cpu_per_message_s"] < 0.1
    # moving a byte costs at least nothing and at most what a slow copy would (0.1 GB/s of processor)
    assert 0 <= costs["cpu_per_byte_s"] < 1e-8
    deadline = time.monotonic() + 5  # the client tells the scheduler what it released, soon after
    while time.monotonic() < deadline:
        held = machine4.client.run_on_scheduler(lambda dask_scheduler: [str(k) for k in dask_scheduler.tasks])
        if not [k for k in held if "taskrt-cpu" in k]:
            break
        time.sleep(0.05)
    assert not [k for k in held if "taskrt-cpu" in k]


@pytest.mark.timeout(600)
@pytest.mark.slow  # starts `dask scheduler` and a `dask worker`, SIGKILLs the scheduler during fit
def test_a_lost_scheduler_ends_fit_with_a_machine_error_naming_the_checkpoint(tmp_path):
    """The scheduler of a separately started cluster killed in the middle of `fit`: one
    MachineError that says so and names the checkpoint to resume from, which then resumes."""
    import signal

    from distributed import Client

    from taskrt.data.datasets import ArrayDataset
    from taskrt.machines.devices import MachineError
    from taskrt.training.checkpoint import Checkpoints

    dask = [sys.executable, "-m", "dask"]
    scheduler_file = tmp_path / "scheduler.json"
    processes = [subprocess.Popen(
        [*dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
         "--scheduler-file", str(scheduler_file)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_for(scheduler_file, processes[0])
        processes.append(subprocess.Popen(
            [*dask, "worker", "--scheduler-file", str(scheduler_file), "--nthreads", "1", "--host", "127.0.0.1",
             "--dashboard-address", "127.0.0.1:0", "--resources", "dev0=1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        graph = models.lenet5(batch=8, image_size=16, width=0.5)
        rng = np.random.default_rng(0)
        data = ArrayDataset({"images": rng.standard_normal((80, 1, 16, 16)).astype(np.float32),
                             "labels": rng.integers(0, 10, 80)})
        client = Client(scheduler_file=str(scheduler_file), timeout="60s")
        client.wait_for_workers(1, timeout=120)
        machine = Machine.from_client(client, probe=False)
        strategy = Strategy({l.name: P() for l in graph if not l.is_input})
        trainer = Trainer(graph, strategy, machine, lr=0.01, checkpoints=Checkpoints(tmp_path / "ckpts", every=4))

        def kill_the_scheduler_at_step_12(step, total):
            if step == 11:
                processes[0].send_signal(signal.SIGKILL)
            return 0.01

        started = time.monotonic()
        with pytest.raises(MachineError, match="lost the connection to the Dask scheduler") as lost:
            trainer.fit(data, epochs=3, progress=False, lr_schedule=kill_the_scheduler_at_step_12)
        assert time.monotonic() - started < 60  # said at once, not after the client's reconnect timeout
        message = str(lost.value)
        assert "The last checkpoint on disk is" in message and "Trainer.load(path, machine)" in message
        latest = Checkpoints(tmp_path / "ckpts", every=4).latest()
        assert str(latest) in message
        client.close(timeout=5)
        with Machine.local(1, probe=False) as fresh:
            resumed = Trainer.load(latest, fresh)
            assert resumed.steps_done == int(latest.stem.split("-")[-1]) >= 4
            assert np.isfinite(resumed.fit(data, epochs=1, progress=False).losses).all()
    finally:
        for process in reversed(processes):
            process.kill()
            process.wait(timeout=20)


def readme_section_blocks(heading: str) -> tuple[str, str]:
    """(shell, python) blocks of the README section `heading`, as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index(f"## {heading}"):]
    section = section[:section.index("\n## ", 3)]
    shell = re.search(r"^```\n(.*?)^```$", section, re.M | re.S).group(1)
    python = re.search(r"^```python\n(.*?)^```$", section, re.M | re.S).group(1)
    return shell, python


@pytest.mark.timeout(900)
@pytest.mark.slow  # the README's cluster section, as written: openssl, `dask scheduler`, two `dask worker`s
def test_the_readme_cluster_section_runs_as_written(tmp_path):
    """A new user's copy of the section on one host: a throwaway certificate, a TLS scheduler and two
    workers started by the shell lines, then the Python block trains the digits."""
    import shutil
    import signal

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    shell, python = readme_section_blocks("Clusters of several hosts, over TLS")
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "TASKRT_CACHE": str(tmp_path / "cache")}
    started = subprocess.Popen(["bash", "-c", shell], cwd=tmp_path, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "cluster.json").exists():
            assert time.monotonic() < deadline, "the scheduler wrote no cluster.json"
            time.sleep(0.2)
        (tmp_path / "wait.py").write_text(
            "from distributed import Client, Security\n"
            "s = Security(tls_ca_file='ca.pem', tls_client_cert='cert.pem', tls_client_key='key.pem',"
            " require_encryption=True)\n"
            "Client(scheduler_file='cluster.json', security=s).wait_for_workers(2, timeout=120)\n")
        subprocess.run([sys.executable, "wait.py"], cwd=tmp_path, env=env, check=True, timeout=180)
        (tmp_path / "train.py").write_text(python)
        done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        accuracies = json.loads(done.stdout.strip().splitlines()[-1].replace("(", "[").replace(")", "]"))
        assert len(accuracies) == 3 and accuracies[-1] >= 0.95, done.stdout
        assert json.loads((tmp_path / "cluster.json").read_text())["address"].startswith("tls://127.0.0.1:")
    finally:
        os.killpg(started.pid, signal.SIGTERM)
        time.sleep(2)
        try:
            os.killpg(started.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

"""The agent's supervisor with real processes: tiny-model workers started, killed, restarted, adopted, drained.

The supervisor is driven by hand (`tick()` in the test thread), so every database write happens in this
thread and the test runs the same on SQLite and PostgreSQL.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone

from inference.actions import nodes as node_workers
from inference.actions import workers as worker_actions
from inference.agent.launch import SupervisorConfig, WorkerSpec, backoff_delay
from inference.agent.processes import is_idle, process_mismatch
from inference.agent.state import Managed, Phase
from inference.agent.supervisor import Supervisor
from inference.models import ScaleEvent, Worker, WorkerStatus
from nodes.models import Node
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker
from tests.support.http_stub import QuietHandler, serving
from tests.support.processes import free_port

pytestmark = pytest.mark.django_db


def status(worker: Worker) -> str:
    return str(Worker.objects.values_list("status", flat=True).get(pk=worker.pk))


def fresh(worker: Worker) -> Worker:
    return Worker.objects.get(pk=worker.pk)


def pending_tiny_decode(tiny_model_dir: Path) -> Worker:
    """A pending decode worker of a one-thread tiny-model deployment on a fresh local node (to be launched
    by a Supervisor of that node)."""
    model = make_model(path=str(tiny_model_dir))
    dep = make_deployment(model=model, context_length=256, batch_size=4, block_size=16, threads_per_worker=1)
    node = make_node(address="127.0.0.1", last_heartbeat=timezone.now())
    return make_worker(dep, node, role="decode", port=free_port(), kv_port=free_port(), status="pending",
                       pid=None, cpu_ids=[0])


def config(log_dir: Path, **overrides: Any) -> SupervisorConfig:
    values: dict[str, Any] = {
        "log_dir": log_dir, "health_interval_s": 0.3, "health_timeout_s": 2.0, "health_failures": 3,
        "startup_timeout_s": 120.0, "backoff_base_s": 0.5, "backoff_max_s": 5.0, "max_restarts": 3,
        "restart_window_s": 120.0, "stop_timeout_s": 5.0, "drain_timeout_s": 60.0, "sync_interval_s": 1.0,
    }
    values.update(overrides)
    return SupervisorConfig(**values)


def kill_leftovers(*pids: int | None) -> None:
    for pid in pids:
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def secret_headers() -> dict[str, str]:
    secret = os.environ.get("PLATFORM_SHARED_SECRET", "")
    return {"X-Platform-Secret": secret} if secret else {}


class HeldDecodeRequest:
    """A decode request that reserved its KV blocks and waits for the prompt KV (as while a prefill runs)."""

    def __init__(self, decode_url: str) -> None:
        self.url = decode_url
        self.request_id = uuid.uuid4().hex
        self._cm = httpx.stream(
            "POST", decode_url + "/internal/decode", headers=secret_headers(), timeout=60,
            json={"request_id": self.request_id, "prompt": "drain me gently", "sampling": {"max_tokens": 8}},
        )
        response = self._cm.__enter__()
        assert response.status_code == 200
        # Keep the line iterator: dropping it closes the stream, and the worker (rightly) frees the
        # reservation of a request whose client hung up.
        self._lines = response.iter_lines()
        self.first = json.loads(next(self._lines))
        assert self.first["type"] == "descriptor", self.first

    def close(self) -> None:
        """Abort it as the router does when the prefill side fails (frees its blocks), and hang up."""
        try:
            httpx.post(self.url + "/internal/abort", json={"request_id": self.request_id},
                       headers=secret_headers(), timeout=10)
        finally:
            self._cm.__exit__(None, None, None)


def test_backoff_delays_and_idle() -> None:
    assert [backoff_delay(n, 1.0, 10.0) for n in range(0, 7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff_delay(10_000, 1.0, 60.0) == 60.0
    assert is_idle({"running": 0, "queue_depth": 0, "kv_usage": 0.0})
    assert not is_idle({"running": 1, "queue_depth": 0})
    assert not is_idle({"running": 0, "queue_depth": 2})
    assert not is_idle({"running": 0, "queue_depth": 0, "kv_usage": 0.25})  # reserved, waiting for KV
    assert not is_idle({"running": "x"})


def test_worker_spec_command_and_environment(tmp_path: Path) -> None:
    model = make_model(path="model_cache/tiny")
    dep = make_deployment(model=model, context_length=1024, max_sequence_length=900, batch_size=8,
                          block_size=32)
    node = make_node(address="10.1.2.3")
    decode = make_worker(dep, node, role="decode", port=30011, kv_port=30012, cpu_ids=[6, 7], gpu_ids=[])
    prefill = make_worker(dep, node, role="prefill", port=30013, cpu_ids=[0], gpu_ids=[1])
    spec = WorkerSpec.from_worker(decode)
    cmd = spec.command("python")
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert cmd[:3] == ["python", "-m", "inference.launch_server"]
    assert flags["--service-type"] == "decode" and flags["--port"] == "30011" and flags["--host"] == "10.1.2.3"
    assert flags["--context-length"] == "1024" and flags["--max-sequence-length"] == "900"
    assert flags["--batch-size"] == "8" and flags["--block-size"] == "32" and flags["--kv-port"] == "30012"
    assert flags["--base-cpu-id"] == "6" and flags["--num-threads"] == "2"
    assert Path(flags["--model-path"]).is_absolute() and flags["--model-path"].endswith("model_cache/tiny")
    assert spec.env({"PATH": "/bin"})["CUDA_VISIBLE_DEVICES"] == ""  # no GPU: CPU worker, as in the guide
    assert WorkerSpec.from_worker(prefill).env({})["CUDA_VISIBLE_DEVICES"] == "1"
    prefill_cmd = WorkerSpec.from_worker(prefill).command()
    assert dict(zip(prefill_cmd[3::2], prefill_cmd[4::2], strict=False))["--kv-port"] == "0"  # no KV listener
    bound = WorkerSpec.from_worker(decode, bind_host="0.0.0.0")
    assert bound.host == "0.0.0.0" and bound.base_url == "http://127.0.0.1:30011"


def test_deployment_speculative_decoding_reaches_the_workers_that_decode(tmp_path: Path) -> None:
    """A deployment's speculative setting is launched as the worker flags on decode and both workers
    (parsed back unchanged by the worker), never on prefill workers; num without ngram is refused."""
    from django.core.exceptions import ValidationError

    from inference.server.args import parse_args

    (tmp_path / "config.json").write_text("{}")
    dep = make_deployment(model=make_model(path=str(tmp_path)), speculative="ngram", num_speculative_tokens=6)
    node = make_node(address="127.0.0.1")
    for role, port in (("decode", 30031), ("both", 30032), ("prefill", 30033)):
        worker = make_worker(dep, node, role=role, port=port, cpu_ids=[0])
        argv = WorkerSpec.from_worker(worker).command()[3:]
        parsed = parse_args(argv)
        if role == "prefill":
            assert "--speculative" not in argv and parsed.speculative is None
        else:
            assert (parsed.speculative, parsed.num_speculative_tokens) == ("ngram", 6), argv
    dep.speculative, dep.num_speculative_tokens = "ngram", None  # the worker's default K
    worker = make_worker(dep, node, role="decode", port=30034, cpu_ids=[0])
    argv = WorkerSpec.from_worker(worker).command()[3:]
    assert "--speculative" in argv and "--num-speculative-tokens" not in argv
    dep.speculative, dep.num_speculative_tokens = "off", 4
    with pytest.raises(ValidationError, match="speculative"):
        dep.full_clean()


def test_server_args_round_trip_through_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """parse_args(to_argv(a)) == a, for a rich configuration and for the one the agent builds."""
    from inference.server.args import ServerArgs, parse_args

    monkeypatch.setenv("PLATFORM_SHARED_SECRET", "s3cret")
    (tmp_path / "config.json").write_text("{}")
    rich = parse_args([
        "--model-path", str(tmp_path), "--service-type", "decode", "--port", "30001", "--host", "10.0.0.5",
        "--kv-port", "30002", "--kv-advertise-host", "10.0.0.6", "--context-length", "512", "--batch-size", "3",
        "--max-num-batched-tokens", "1024", "--dtype", "float32", "--no-prefix-caching", "--no-chunked-prefill",
        "--base-cpu-id", "0", "--num-threads", "1", "--max-sequence-length", "600", "--block-size", "32",
        "--num-kv-blocks", "64", "--kv-lease-timeout", "12.5", "--max-queue", "9", "--max-tokens-limit", "99",
        "--served-model-name", "tiny", "--log-level", "debug",
    ])
    assert not rich.prefix_caching and not rich.chunked_prefill  # the switches are part of the trip
    assert parse_args(rich.to_argv()) == rich
    plain = parse_args(["--model-path", str(tmp_path), "--service-type", "prefill"])
    assert parse_args(plain.to_argv()) == plain
    assert "--no-prefix-caching" not in plain.to_argv() and "s3cret" not in " ".join(rich.to_argv())
    # What the agent launches: WorkerSpec → ServerArgs → argv, parsed back by the worker unchanged.
    dep = make_deployment(model=make_model(path=str(tmp_path)), context_length=256, block_size=16)
    node = make_node(address="127.0.0.1")
    worker = make_worker(dep, node, role="decode", port=30021, kv_port=30022, cpu_ids=[0])
    spec = WorkerSpec.from_worker(Worker.objects.select_related("deployment__model", "node").get(pk=worker.pk))
    built = spec.server_args()
    assert parse_args(spec.command()[3:]) == built == ServerArgs.with_defaults(**vars(built))
    assert (built.port, built.kv_port, built.base_cpu_id, built.kv_transport) == (30021, 30022, 0, "tcp")


def test_real_worker_crash_restart_adopt_and_drain(tiny_model_dir: Path, log_dir: Path) -> None:
    """A real tiny-model decode worker: SIGKILL → restarted (restarts + 1); a restarted agent adopts it;
    drained with a request in flight, it stops only once that request is gone."""
    decode = pending_tiny_decode(tiny_model_dir)
    node = decode.node
    first = Supervisor(node.pk, config(log_dir / f"agent-{uuid.uuid4().hex[:6]}"))
    second: Supervisor | None = None
    pids: list[int | None] = []
    held: HeldDecodeRequest | None = None
    try:
        assert first.request_start(decode.pk) == "starting"
        assert first.request_start(decode.pk) == "already managed"
        ok = first.wait_until(lambda: status(decode) == WorkerStatus.RUNNING, timeout=150)
        assert ok, fresh(decode).last_error
        d = fresh(decode)
        pids.append(d.pid)
        assert d.pid and d.restarts == 0
        assert d.last_health["status"] == "healthy" and d.last_health["role"] == "decode"
        url = f"http://127.0.0.1:{d.port}"
        assert httpx.get(url + "/info").json()["kv_port"] == d.kv_port

        # SIGKILL: the supervisor sees the exit and restarts the worker, counting the restart.
        os.kill(d.pid, signal.SIGKILL)
        assert first.wait_until(lambda: status(decode) != WorkerStatus.RUNNING, timeout=10, interval=0.05)
        crashed = fresh(decode)
        assert "exited with code -9" in crashed.last_error and "restart in 0.5s" in crashed.last_error
        restarted = first.wait_until(
            lambda: fresh(decode).restarts == 1 and status(decode) == WorkerStatus.RUNNING, timeout=150
        )
        d2 = fresh(decode)
        assert restarted, d2.last_error
        assert d2.pid and d2.pid != d.pid
        pids.append(d2.pid)

        # The agent restarts: a new supervisor adopts the running process instead of relaunching it.
        assert d2.process_started_at and abs(d2.process_started_at - psutil_start(d2.pid)) < 0.01
        second = Supervisor(node.pk, config(log_dir / f"agent-{uuid.uuid4().hex[:6]}"))
        assert second.recover()["adopted"] == [decode.pk]
        adopted = ScaleEvent.objects.get(deployment=decode.deployment, reason__startswith="adopted")
        assert adopted.source == "recovery" and f"pid {d2.pid}" in adopted.reason
        second.tick()
        assert fresh(decode).pid == d2.pid and status(decode) == WorkerStatus.RUNNING
        assert second.managed()[decode.pk].phase == Phase.RUNNING

        # Drain with a request in flight: the worker keeps running until the request is gone.
        held = HeldDecodeRequest(url)
        assert second.request_stop(decode.pk, drain=True) == "draining"
        for _ in range(4):
            second.tick()
            time.sleep(0.2)
        assert status(decode) == WorkerStatus.DRAINING
        assert second.managed()[decode.pk].phase == Phase.DRAINING and psutil_alive(d2.pid)
        held.close()
        held = None
        assert second.wait_until(lambda: status(decode) == WorkerStatus.STOPPED, timeout=30), fresh(decode)
        assert fresh(decode).pid is None and not psutil_alive(d2.pid)
        assert not second.managed()
    finally:
        if held is not None:
            held.close()
        for sup in (first, second):
            if sup is not None:
                pids += [m.pid for m in sup.managed().values()]
        kill_leftovers(*pids)


def psutil_start(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).create_time())


def psutil_alive(pid: int | None) -> bool:
    import psutil

    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_crash_loop_backs_off_then_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that cannot start (no model there) is restarted with growing delays, then FAILED."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    dep = make_deployment(model=make_model(path=str(empty)))
    node = make_node(address="127.0.0.1")
    worker = make_worker(dep, node, role="prefill", port=free_port(), status="pending", pid=None)
    crashes: list[str] = []
    launches: list[float] = []
    real_crashed, real_launched = worker_actions.report_crashed, worker_actions.report_launched

    def crashed(worker_id: int, *, error: str) -> bool:
        crashes.append(error)
        return real_crashed(worker_id, error=error)

    def launched(worker_id: int, *, pid: int, restart: bool, started_at: float | None = None) -> bool:
        launches.append(time.monotonic())
        return real_launched(worker_id, pid=pid, restart=restart, started_at=started_at)

    monkeypatch.setattr(worker_actions, "report_crashed", crashed)
    monkeypatch.setattr(worker_actions, "report_launched", launched)
    sup = Supervisor(node.pk, config(tmp_path / "logs", backoff_base_s=0.3, max_restarts=2))
    sup.request_start(worker.pk)
    assert sup.wait_until(lambda: status(worker) == WorkerStatus.FAILED, timeout=60, interval=0.05)
    failed = fresh(worker)
    assert failed.restarts == 2 and failed.pid is None
    assert "gave up after 3 crashes" in failed.last_error
    assert "no config.json" in failed.last_error  # the worker's own message, from its log
    assert ["restart in 0.3s" in crashes[0], "restart in 0.6s" in crashes[1]] == [True, True]
    assert len(launches) == 3
    assert launches[1] - launches[0] >= 0.3 and launches[2] - launches[1] >= 0.6
    assert not sup.managed()


class _BusyHealth(QuietHandler):
    """/health of a worker that never becomes idle."""

    def do_GET(self) -> None:  # noqa: N802
        self.reply(200, json.dumps({"status": "healthy", "running": 1, "queue_depth": 0, "kv_usage": 0.2}).encode())


@pytest.fixture
def busy_health() -> Iterator[int]:
    with serving(_BusyHealth) as port:
        yield port


def test_drain_is_bounded_and_sigterm_escalates_to_sigkill(tmp_path: Path, busy_health: int) -> None:
    """A worker that stays busy is stopped after the drain timeout; one ignoring SIGTERM gets SIGKILL."""
    node = make_node(address="127.0.0.1")
    worker = make_worker(make_deployment(), node, role="decode", port=busy_health, status="running", pid=None)
    stubborn = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
         "time.sleep(120)"],
        stdout=subprocess.PIPE, start_new_session=True,
    )
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == b"up"  # handler installed
        Worker.objects.filter(pk=worker.pk).update(pid=stubborn.pid)
        sup = Supervisor(node.pk, config(tmp_path, drain_timeout_s=1.0, stop_timeout_s=1.0))
        spec = WorkerSpec.from_worker(Worker.objects.select_related("deployment__model", "node").get(pk=worker.pk))
        sup._procs[worker.pk] = Managed(spec=spec, log_path=tmp_path / "w.log", popen=stubborn, pid=stubborn.pid,
                                        phase=Phase.RUNNING, launches=1)
        started = time.monotonic()
        assert sup.request_stop(worker.pk, drain=True) == "draining"
        assert sup.wait_until(lambda: status(worker) == WorkerStatus.STOPPED, timeout=20, interval=0.05)
        elapsed = time.monotonic() - started
        assert elapsed >= 2.0  # drain timeout (1 s) + SIGTERM ignored for the stop timeout (1 s)
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        assert not sup.managed()
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()


def test_sync_stops_a_worker_the_controller_gave_up_on(tmp_path: Path) -> None:
    node = make_node(address="127.0.0.1")
    worker = make_worker(make_deployment(), node, status="running", pid=None)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        sup = Supervisor(node.pk, config(tmp_path))
        spec = WorkerSpec.from_worker(Worker.objects.select_related("deployment__model", "node").get(pk=worker.pk))
        sup._procs[worker.pk] = Managed(spec=spec, log_path=tmp_path / "w.log", popen=sleeper, pid=sleeper.pid,
                                        phase=Phase.RUNNING, launches=1)
        node_workers.mark_node_offline(node, reason="test")  # the controller gives up on the node's workers
        sup.sync_with_db()
        assert sup.wait_until(lambda: not sup.managed(), timeout=15, interval=0.05)
        assert sleeper.wait(timeout=5) == -signal.SIGTERM
        assert status(worker) == WorkerStatus.STOPPED
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_stop_of_an_unknown_worker_marks_it_stopped(tmp_path: Path) -> None:
    node = make_node()
    worker = make_worker(make_deployment(), node, status="draining")
    sup = Supervisor(node.pk, config(tmp_path))
    assert sup.request_stop(worker.pk, drain=True) == "not running; marked stopped"
    assert status(worker) == WorkerStatus.STOPPED
    other = make_worker(make_deployment(), make_node(), status="pending")
    assert sup.request_start(other.pk) == "not a worker of this node"


def test_sync_starts_live_workers_nobody_runs_and_recover_relaunches_lost_ones(tmp_path: Path) -> None:
    node: Node = make_node(address="127.0.0.1")
    dep = make_deployment()
    pending = make_worker(dep, node, status="pending", pid=None)
    lost = make_worker(dep, node, status="running", pid=2**22 + 4321)  # its process is gone
    draining_gone = make_worker(dep, node, status="draining", pid=2**22 + 4322)
    sup = Supervisor(node.pk, config(tmp_path))
    outcome = sup.recover()
    assert outcome["relaunched"] == sorted([pending.pk, lost.pk])
    assert outcome["stopped"] == [draining_gone.pk]
    assert status(draining_gone) == WorkerStatus.STOPPED
    assert sup.managed()[lost.pk].count_next_launch_as_restart  # the agent lost it: a restart
    sup._procs.clear()
    sup.sync_with_db()  # a lost start message: the periodic sync picks the PENDING worker up
    assert pending.pk in sup.managed()
    sup._procs.clear()


# A stand-in for a worker process left behind by a dead agent: its command line names launch_server and
# its port (what adoption matches), and its /health reports it idle, so a drain finishes at once.
FAKE_WORKER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "healthy", "running": 0, "queue_depth": 0, "kv_usage": 0.0}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
"""


def start_fake_worker(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", FAKE_WORKER, "inference.launch_server", "--port", str(port)],
                            start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("the fake worker did not come up")


def test_recover_drains_and_stops_the_orphan_of_a_replaced_worker(tmp_path: Path) -> None:
    """A worker failed over while its agent was away: the next agent drains its process and stops it."""
    node = make_node(address="127.0.0.1")
    dep = make_deployment()
    port = free_port()
    orphan = start_fake_worker(port)
    try:
        replaced = make_worker(dep, node, role="decode", port=port, status="stopped", pid=orphan.pid,
                               process_started_at=psutil_start(orphan.pid))
        sup = Supervisor(node.pk, config(tmp_path))
        assert sup.recover()["reaped"] == [replaced.pk]
        assert orphan.poll() is None  # not killed on sight: its requests in flight may finish
        event = ScaleEvent.objects.get(deployment=dep)
        assert event.source == "recovery" and event.reason.startswith("reap:") and str(orphan.pid) in event.reason
        assert sup.wait_until(lambda: not sup.managed(), timeout=20, interval=0.05)
        assert orphan.wait(timeout=10) == -signal.SIGTERM
        stopped = fresh(replaced)
        assert stopped.status == WorkerStatus.STOPPED and stopped.pid is None
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def test_recover_does_not_adopt_a_process_with_another_start_time(tmp_path: Path) -> None:
    """Same pid and port but another start time: not this worker's process (a reused pid); relaunched."""
    node = make_node(address="127.0.0.1")
    port = free_port()
    other = start_fake_worker(port)
    try:
        worker = make_worker(make_deployment(), node, role="decode", port=port, status="running", pid=other.pid,
                             process_started_at=psutil_start(other.pid) - 3600.0)
        sup = Supervisor(node.pk, config(tmp_path))
        outcome = sup.recover()
        assert outcome["adopted"] == [] and outcome["relaunched"] == [worker.pk]
        assert not ScaleEvent.objects.filter(reason__startswith="adopted").exists()
    finally:
        other.kill()
        other.wait()


def test_process_mismatch_says_why_a_pid_is_not_the_workers() -> None:
    """The reason a restarted agent logs for a worker it does not adopt."""
    import psutil

    here = psutil.Process(os.getpid())
    assert process_mismatch(os.getpid(), 1234) == "not a launch_server process"
    assert "started at" in str(process_mismatch(os.getpid(), 1234, here.create_time() + 5))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert str(process_mismatch(child.pid, 1234)).startswith("no such process")

"""tplib.runtime.torchrun across two hosts, and a peer that never arrives.

Two network namespaces on this machine, joined by a veth pair, stand for two nodes: each
has an interface and address of its own (10.77.0.1 and 10.77.0.2, which exist only inside
the namespaces, so they clash with nothing outside) and runs torchrun as one node of a
two-node job: c10d rendezvous on node 0's address, gloo bound to the namespace's
interface. A K = 2 pipeline and a K = 2 x #Op = 2 layout (two ranks per node) train there
and must match the single-process reference; rank 0 writes the results file atomically.

A node whose torchrun never starts ends at torchrun's rendezvous (``join_timeout``), and a
node whose worker never joins ends the run within ``Timing.timeout_s`` with
:class:`~tplib.runtime.torchrun.MissingRanksError` naming the ranks waited for.

The namespaces need root and iproute2's ``ip``; without them those tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tplib.runtime import Data, Parallelism, RunConfig, Timing, save_run_config, train_reference
from tplib.runtime.backend import BackendError
from tplib.runtime.heartbeat import Beat, Heartbeat, RankLostError
from tplib.runtime.rank import Progress, spans
from tplib.runtime.torchrun import (
    MissingRanksError,
    StoppedError,
    _await_every_rank,
    _backend,
    _failure,
    _OnSigterm,
    load_result,
)

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SUBNET = "10.77.0"  # private, and only ever inside this module's own namespaces
PORT = 29400  # rendezvous port on node 0; each test adds its own offset
WALL_S = 120  # the most any job here may take before the test calls it hung


@dataclass(frozen=True)
class Host:
    """A network namespace standing for a node: its interface and address."""

    ns: str
    ifname: str
    addr: str

    def torchrun(
        self, head: Host, port: int, nproc: int, *args: str, join_timeout: int = 30
    ) -> list[str]:
        """torchrun as this node of a two-node job whose rendezvous is on ``head``."""
        is_head = int(self == head)
        return [
            *("ip", "netns", "exec", self.ns, "env", f"GLOO_SOCKET_IFNAME={self.ifname}"),
            "OMP_NUM_THREADS=1",
            TORCHRUN,
            *("--nnodes", "2", "--nproc-per-node", str(nproc)),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head.addr}:{port}"),
            # Both namespaces share this machine's hostname, which resolves to neither
            # address (here to loopback): from it torchrun could neither tell that the head
            # hosts the endpoint (is_host) nor publish a reachable MASTER_ADDR to the
            # workers (--local-addr). On a cluster, where a node's hostname resolves to
            # its address, both come out right by themselves.
            *("--rdzv-conf", f"is_host={is_head},join_timeout={join_timeout}"),
            *("--local-addr", self.addr),
            *args,
        ]


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode:
        pytest.skip(f"cannot make the test's network: `ip {' '.join(args)}`: {proc.stderr}")


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair, removed afterwards (which removes the pair)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command: apt-get install -y iproute2")
    tag = secrets.token_hex(3)  # a run of its own: interface names fit in 15 characters
    pair = tuple(Host(f"tplib-{tag}-{i}", f"tp{tag}n{i}", f"{SUBNET}.{i + 1}") for i in (0, 1))
    made: list[str] = []
    try:
        for host in pair:
            _ip("netns", "add", host.ns)
            made.append(host.ns)
        a, b = pair
        _ip("link", "add", a.ifname, "netns", a.ns, "type", "veth", "peer", b.ifname, "netns", b.ns)
        for host in pair:
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.ns, "link", "set", host.ifname, "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants. torchrun starts each worker in a session of its own,
    so killing the agent's process group would leave the workers running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


class Nodes:
    """The torchrun processes of one test, by name; all killed when it ends."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> None:
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float = WALL_S) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running after {timeout} s: hung\n{self.tails()}")

    def tails(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name)[-3000:]}" for name in self.procs)

    def kill(self) -> None:
        trees = [_process_tree(p.pid) for p in self.procs.values() if p.poll() is None]
        for pid in (pid for tree in trees for pid in tree):
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGKILL)
        for p in self.procs.values():
            p.wait()


@pytest.fixture()
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    (tmp_path / "logs").mkdir()
    started = Nodes(tmp_path / "logs")
    try:
        yield started
    finally:
        started.kill()


def _entry(run: RunConfig, run_dir: Path) -> list[str]:
    """Write ``run`` to ``run_dir/run.json``; the module torchrun starts on every node."""
    run_dir.mkdir()
    save_run_config(run, run_dir / "run.json")
    config, out = str(run_dir / "run.json"), str(run_dir / "result.pt")
    return ["-m", "tplib.runtime.torchrun", "--config", config, "--out", out, "--collect", "params"]


def _tiny(parallelism: Parallelism, timeout_s: float = 60, **fields: Any) -> RunConfig:
    """A tiny model's terapipe run: two steps of two sequences of 16 tokens in 2 slices."""
    return RunConfig(
        parallelism=parallelism,
        data=Data(batch=2, seq_len=16),
        slicing=2,
        timing=Timing(steps=2, threads=1, timeout_s=timeout_s),
        **fields,
    )


LAYOUTS = {
    "K2": _tiny(Parallelism(n_stages=2)),
    # #Op inside a node, the pipeline across nodes: stage 0 on node 0, stage 1 on node 1.
    "K2xOp2": _tiny(Parallelism(n_stages=2, n_op=2, ranks_per_node=2)),
}


def test_two_nodes_train_what_one_process_trains(
    hosts: tuple[Host, Host], nodes: Nodes, tmp_path: Path
) -> None:
    """Every layout at once, each on a rendezvous port of its own: their startups, mostly
    importing torch, overlap."""
    head = hosts[0]
    for i, (layout, run) in enumerate(LAYOUTS.items()):
        entry = _entry(run, tmp_path / layout)
        for n, host in enumerate(hosts):
            nodes.start(
                f"{layout}-node{n}",
                host.torchrun(head, PORT + i, run.parallelism.world_size // 2, *entry),
            )
    # The reference depends on the model, the batch and the optimiser, not on the layout.
    ref = train_reference(LAYOUTS["K2"])
    for layout, run in LAYOUTS.items():
        codes = [nodes.wait(f"{layout}-node{n}") for n in (0, 1)]
        assert codes == [0, 0], f"{layout}: exit codes {codes}\n{nodes.tails()}"
        # Rank 0 alone wrote, to a temporary file renamed into place: nothing else is left.
        assert sorted(p.name for p in (tmp_path / layout).iterdir()) == ["result.pt", "run.json"]
        result = load_result(tmp_path / layout / "result.pt")
        assert result.config == run
        assert [(r.rank, r.stage, r.op_rank) for r in result.ranks] == [
            (rank, *run.parallelism.position(rank)[1:3])
            for rank in range(run.parallelism.world_size)
        ], layout
        # What tests/test_runtime.py asks of every layout on one machine.
        _close(result.losses, ref.losses, f"{layout} losses", atol=1e-5)
        _close(result.grad_norms, ref.grad_norms, f"{layout} gradient norms", atol=0)
        params = result.params()  # the op ranks' shards joined
        assert {_model_name(run, s, n) for s, n in params} == set(ref.params), layout
        for (stage, name), p in params.items():
            what = f"{layout} parameter {name} after the steps"
            _close_tensor(p, ref.params[_model_name(run, stage, name)], what)
        assert f"backend gloo: {run.parallelism.world_size} ranks on CPU" in nodes.log(
            f"{layout}-node0"
        )


def _close_tensor(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _model_name(run: RunConfig, stage: int, name: str) -> str:
    # A last stage's LM head is the model's tied token embedding.
    last = stage == run.parallelism.n_stages - 1
    return "wte.weight" if last and name == "head.weight" and run.cfg.tie_embeddings else name


def _close(actual: list[float], expected: list[float], what: str, atol: float) -> None:
    torch.testing.assert_close(
        torch.tensor(actual),
        torch.tensor(expected),
        rtol=1e-5,
        atol=atol,
        msg=lambda m: f"{what}: {m}",
    )


def test_a_node_that_never_starts_fails_the_rendezvous_in_its_timeout(
    hosts: tuple[Host, Host], nodes: Nodes, tmp_path: Path
) -> None:
    """torchrun's, before tplib runs: a bare RendezvousTimeoutError after join_timeout."""
    head = hosts[0]
    entry = _entry(LAYOUTS["K2"], tmp_path / "run")
    start = time.monotonic()
    nodes.start("node0", head.torchrun(head, PORT + 10, 1, *entry, join_timeout=2))
    code = nodes.wait("node0")
    elapsed = time.monotonic() - start
    assert code != 0 and "RendezvousTimeoutError" in nodes.log("node0"), nodes.tails()
    assert elapsed < 30, f"{elapsed:.1f} s for a 2 s join timeout"
    assert not (tmp_path / "run" / "result.pt").exists()


def test_a_worker_that_never_joins_is_named_within_the_timeout(
    hosts: tuple[Host, Host], nodes: Nodes, tmp_path: Path
) -> None:
    """Node 1 joins the rendezvous, but its worker never joins the job (it sleeps): node 0
    fails within Timing.timeout_s naming the rank, node and stage it waited for."""
    head, other = hosts
    run = _tiny(Parallelism(n_stages=2), timeout_s=2)
    entry = _entry(run, tmp_path / "run")
    start = time.monotonic()
    nodes.start("node0", head.torchrun(head, PORT + 20, 1, *entry))
    nodes.start("node1", other.torchrun(head, PORT + 20, 1, "--no-python", "sleep", str(WALL_S)))
    code = nodes.wait("node0")
    elapsed = time.monotonic() - start
    log = nodes.log("node0")
    assert code != 0, log[-3000:]
    assert f"MissingRanksError: rank 0 of 2 waited 2 s (Timing.timeout_s) at {head.addr}:" in log, (
        log[-3000:]
    )
    assert "for rank(s) 1 (node(s) 1, stage(s) 1) to join; they never arrived" in log
    assert elapsed < 45, f"{elapsed:.1f} s for a 2 s timeout"
    assert not (tmp_path / "run" / "result.pt").exists()


# ---- the arrival check alone: no namespaces, no torchrun ---------------------------------


def test_spans_compacts_consecutive_ranks() -> None:
    assert spans([5, 0, 1, 2, 8, 7, 7]) == "0-2, 5, 7-8"
    assert spans([3]) == "3" and spans([]) == ""


def test_await_every_rank_names_the_missing_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 0 and 1 (node 0, stage 0) arrived, ranks 2-3 (node 1, stage 1) never do."""
    run = RunConfig(
        parallelism=Parallelism(n_stages=2, n_op=2, ranks_per_node=2),
        data=Data(batch=2, seq_len=16),
        timing=Timing(timeout_s=1),
    )
    timeout = datetime.timedelta(seconds=run.timing.timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    _await_every_rank(run, timeout)  # not under torchrun: nothing to wait for here
    env = {"RANK": 0, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": store.port}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store.set("tplib/arrived/0/1", "1")
    start = time.monotonic()
    with pytest.raises(
        MissingRanksError,
        match=r"rank 0 of 4 waited 1 s \(Timing.timeout_s\) at 127.0.0.1:\d+ for rank\(s\) "
        r"2-3 \(node\(s\) 1, stage\(s\) 1\) to join",
    ):
        _await_every_rank(run, timeout)
    assert time.monotonic() - start < 10


# ---- the GPU exchange and the failure report, against a store in this process -----------


@dataclass
class _FakeProperties:
    uuid: str


@pytest.fixture()
def agent_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    """A store in this process standing for torchrun's agents': the environment torchrun
    gives rank 1 of 2, one rank a node, on its only GPU."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        timeout=datetime.timedelta(seconds=5),
        wait_for_workers=False,
    )
    env = {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 1, "LOCAL_RANK": 0}
    for name, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": store.port}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    yield store


@pytest.mark.parametrize(
    ("other_gpu", "asked", "backend"),
    [("GPU-b", None, "nccl"), ("GPU-a", None, "gloo"), ("GPU-b", "gloo", "gloo")],
)
def test_ranks_compare_gpu_uuids_in_the_agents_store(
    agent_store: dist.TCPStore,
    monkeypatch: pytest.MonkeyPatch,
    other_gpu: str,
    asked: str | None,
    backend: str,
) -> None:
    """Each process sees one GPU, its "cuda:0" (SLURM's --gpus-per-task=1): NCCL exactly
    when the UUIDs differ. Rank 0 (on the other node) arrived with ``other_gpu``."""
    made_current: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _FakeProperties("GPU-a"))
    agent_store.set("tplib/arrived/0/0", other_gpu)
    run = _tiny(Parallelism(n_stages=2), device="cuda", precision="fp32")
    choice = _backend(run, asked, datetime.timedelta(seconds=5))
    assert choice.backend == backend and made_current == [0]
    assert agent_store.get("tplib/arrived/0/1") == b"GPU-a"  # what rank 0 compares
    if other_gpu == "GPU-a":
        assert choice.reason.startswith("ranks 0, 1 share GPU GPU-a")
        with pytest.raises(BackendError, match="backend 'nccl' with ranks 0, 1 share GPU GPU-a"):
            _backend(run, "nccl", datetime.timedelta(seconds=5))


def test_a_rank_that_stopped_reporting_is_named(
    agent_store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's receive broke; rank 0 wrote last at action 5 of iteration 2, then nothing:
    the error names it. Once rank 0 writes again, rank 1's own error stands, with what
    every rank is doing."""
    run = _tiny(Parallelism(n_stages=2))
    agent_store.set("tplib/progress/0/0", Beat(4, 1, 4).encode())
    agent_store.set("tplib/progress/0/1", Beat(9, 1, 7).encode())  # this rank's, never moves
    progress = Progress.local(2)
    progress.set(1, 1, 7)
    cause = ConnectionError("stage 1 (rank 1) lost its peer after 0.0 s")
    error = _failure(run, 1, progress, cause)
    assert isinstance(error, RankLostError)
    assert str(error).startswith(
        "rank 0 (stage 0, replica 0) on node 0 stopped reporting (it exited, was killed or "
        "froze) while running "
    )
    assert "action 5 of" in str(error) and "iteration 2 of 2" in str(error)
    assert str(error).endswith(f"when it failed: {type(cause).__name__}: {cause}")
    client = dist.TCPStore("127.0.0.1", agent_store.port, is_master=False)
    alive = Heartbeat(client, "tplib/progress/0", 0, Progress.local(2), period_s=0.05).start()
    try:
        assert _failure(run, 1, progress, cause) is cause
    finally:
        alive.stop()
    assert cause.__notes__[0].startswith("Every rank still reports; what each was doing:")


def test_sigterm_stops_a_rank_unless_it_is_reporting() -> None:
    handler = _OnSigterm()
    with pytest.raises(StoppedError, match="torchrun's agent stops every rank of a node"):
        handler(15, None)
    handler.reporting = True
    handler(15, None)  # ignored: the report is written, then the rank exits

"""A model's ranks on two "machines": two launches on 127.0.0.1, node 0 serving the API
(`--nnodes 2 --node-rank 0`) and node 1 running only its rank (`--headless`).

Node 1's rank gets the step commands over a gloo group (no pipe crosses machines); a
killed rank on node 1 fails the in-flight streams, /health goes 503 and comes back
once node 1 has started its rank again and the worker on node 0 has restarted."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest

from laneserve.config import EngineConfig, ModelConfig, ParallelConfig, WorkerConfig
from laneserve.engine_args import EngineArgs
from laneserve.worker.ranks import config_digest
from tests.distributed.kill_streams import kill_during_streams
from tests.server.conftest import Server, free_port, start_server, stop_server, wait_for

STREAM = {"model": "tiny", "prompt": "The old lighthouse", "max_tokens": 240, "ignore_eos": True}


def _config(**parallel: object) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="m"),
        worker=WorkerConfig(mode="process"),
        parallel=ParallelConfig(tensor_parallel_size=2, **parallel),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"nnodes": 0}, "nnodes must be >= 1"),
        ({"nnodes": 2, "node_rank": 2}, "node_rank must be in [0, nnodes - 1 = 1]"),
        ({"nnodes": 2, "node_rank": -1}, "node_rank must be in"),
        ({"nnodes": 3}, "does not divide over nnodes 3"),
        ({"nnodes": 2, "master_port": 0}, "master_port must be a TCP port"),
    ],
)
def test_bad_node_settings_are_refused(parallel: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        _config(**parallel).validate()


def test_each_node_runs_its_own_ranks() -> None:
    p = ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1)
    assert p.ranks_per_node == 2 and list(p.node_ranks()) == [2, 3]
    assert list(ParallelConfig(tensor_parallel_size=4).node_ranks()) == [0, 1, 2, 3]


def test_nodes_compare_model_and_flags_not_their_own_settings() -> None:
    head = _config(nnodes=2, node_rank=0)
    node1 = _config(nnodes=2, node_rank=1)
    node1 = msgspec.structs.replace(node1, worker=WorkerConfig(mode="process", lane_times=True))
    assert config_digest(head) == config_digest(node1)
    other = msgspec.structs.replace(node1, model=ModelConfig(model="m", dtype="bfloat16"))
    assert config_digest(other) != config_digest(head)
    assert config_digest(_config(nnodes=2, master_port=29502)) != config_digest(head)


def test_the_flags_reach_the_config() -> None:
    import argparse

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    flags = "--model m --tensor-parallel-size 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1"
    ns = p.parse_args([*flags.split(), "--master-port", "29600", "--worker-mode", "process"])
    par = EngineArgs.from_cli(ns).create_config().parallel
    assert (par.nnodes, par.node_rank, par.master_addr, par.master_port) == (
        2,
        1,
        "10.0.0.1",
        29600,
    )


def _dp_config(**parallel: object) -> EngineConfig:
    p = {"data_parallel_size": 2, "nnodes": 2, "enable_expert_parallel": True, **parallel}
    return EngineConfig(
        model=ModelConfig(model="m"),
        worker=WorkerConfig(mode="process"),
        parallel=ParallelConfig(**p),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"enable_expert_parallel": False}, "runs with --enable-expert-parallel only"),
        ({"data_parallel_size": 3}, "data_parallel_size 3 does not divide over nnodes 2"),
        ({"tensor_parallel_size": 2}, "with tensor_parallel_size > 1 is not supported"),
        ({"node_rank": 2}, "node_rank must be in"),
    ],
)
def test_bad_data_parallel_node_settings_are_refused(parallel: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _dp_config(**parallel).validate()


def test_each_node_runs_its_own_data_parallel_ranks() -> None:
    _dp_config(data_parallel_size=4).validate()  # expert parallelism over nodes is accepted
    p = _dp_config(data_parallel_size=4, node_rank=1, master_addr="10.0.0.1").parallel
    assert (p.dp_ranks_per_node, list(p.node_dp_ranks()), p.ranks_per_node) == (2, [2, 3], 1)
    assert p.experts_addr == "10.0.0.1"  # the experts' group meets at node 0
    one = ParallelConfig(data_parallel_size=2, master_addr="10.0.0.1")
    assert (one.dp_ranks_per_node, one.experts_addr) == (2, "127.0.0.1")


def test_the_digest_ignores_what_the_engine_sets_per_rank() -> None:
    head = _dp_config()
    rank1 = msgspec.structs.replace(
        head,
        parallel=msgspec.structs.replace(
            head.parallel, data_parallel_rank=1, data_parallel_master_port=40000
        ),
    )
    node1 = msgspec.structs.replace(
        head, parallel=msgspec.structs.replace(head.parallel, node_rank=1)
    )
    assert config_digest(rank1) == config_digest(node1) == config_digest(head)
    assert config_digest(_dp_config(data_parallel_size=4)) != config_digest(head)


def _parse(flags: str) -> EngineArgs:
    import argparse

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return EngineArgs.from_cli(
        p.parse_args(["--model", "m", "--worker-mode", "process", *flags.split()])
    )


DP_NODES = "--data-parallel-size 2 --enable-expert-parallel --nnodes 2"


def test_vllms_data_parallel_address_and_rpc_port_name_node_0() -> None:
    flags = f"{DP_NODES} --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 29600"
    par = _parse(flags).create_config().parallel
    assert (par.master_addr, par.master_port) == ("10.0.0.1", 29600)
    same = _parse(f"{flags} --master-addr 10.0.0.1").create_config().parallel
    assert same.master_addr == "10.0.0.1"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (f"{DP_NODES} --data-parallel-size-local 1", "use --nnodes|give --nnodes N"),
        (f"{DP_NODES} --data-parallel-start-rank 1", "--node-rank k"),
        ("--data-parallel-size 2 --data-parallel-address 10.0.0.1", "use --master-addr"),
        (f"{DP_NODES} --data-parallel-address 10.0.0.1 --master-addr 10.0.0.2", "differ"),
        (f"{DP_NODES} --data-parallel-rpc-port 29600 --master-port 29700", "differ"),
    ],
)
def test_vllms_other_data_parallel_flags_are_refused(flags: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parse(flags).create_config()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--headless"], "needs --nnodes > 1"),
        (["--headless", "--nnodes", "2"], "for nodes 1..nnodes-1"),
        (["--nnodes", "2", "--node-rank", "1"], "add --headless"),
    ],
)
def test_node_roles_are_checked_before_anything_loads(
    tiny_models: dict[str, Path], flags: list[str], message: str
) -> None:
    cmd = [sys.executable, "-m", "laneserve.entrypoints.cli", "serve", str(tiny_models["llama"])]
    r = subprocess.run(
        [*cmd, "--tensor-parallel-size", "2", *flags], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and message in r.stdout, (r.stdout, r.stderr)


TP2 = ("--tensor-parallel-size", "2")


def headless(model: Path, port: int, *extra: str, sizes: tuple[str, ...] = TP2) -> subprocess.Popen:
    """Node 1's launch (`serve --headless --node-rank 1`), its output piped."""
    cmd = [
        sys.executable, "-m", "laneserve.entrypoints.cli", "serve", str(model), "--headless",
        "--dtype", "float32", "--max-model-len", "256", *sizes,
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
        "--master-port", str(port), *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _head(model: Path, port: int) -> Server:
    flags = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port))
    return start_server(model, *flags)


def node_rank_pids(launcher: subprocess.Popen) -> list[int]:
    """Node 1's rank processes (spawned children of the headless launcher)."""
    out = []
    for task in Path(f"/proc/{launcher.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                out.append(int(pid))
    return sorted(out)


def node_rank_pid(launcher: subprocess.Popen) -> int:
    """Node 1's one rank process."""
    (pid,) = node_rank_pids(launcher)
    return pid


def end(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.stdout.read() if proc.stdout else ""


def _plain_greedy(model: Path, prompt: str) -> str:
    from laneserve import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    return text


@pytest.mark.slow  # two launches, two model loads, a rank restart
def test_two_nodes_serve_and_a_killed_node_rank_is_a_worker_death(
    tiny_models: dict[str, Path],
) -> None:
    model, port = tiny_models["llama"], free_port()
    node1 = headless(model, port)
    head = None
    try:
        head = _head(model, port)
        reference = head.greedy()
        assert reference == _plain_greedy(model, "The old lighthouse stood at the end")
        rank = node_rank_pid(node1)
        health = kill_during_streams(head, rank, 2, STREAM)
        wait_for(lambda: 503 in health.seen and health.seen[-1] == 200, "health 503, then 200")
        health.close()
        assert node_rank_pid(node1) != rank  # node 1 started its rank again
        assert head.greedy() == reference
        assert httpx.get(f"{head.url}/health").status_code == 200
    finally:
        if head is not None:
            stop_server(head)
        end(node1)


def refused_on_both_sides(
    model: Path,
    head: Callable[[Path, int], Server],
    sizes: tuple[str, ...],
    head_says: str,
    node_says: str,
) -> None:
    """Node 1 started with another `--block-size`: node 0 (`head(model, port)`) fails to
    start saying `head_says`, node 1 exits 2 saying `node_says`."""
    port = free_port()
    node1 = headless(model, port, "--block-size", "8", sizes=sizes)
    try:
        with pytest.raises(RuntimeError, match=head_says):
            head(model, port)
        assert node1.wait(120) == 2
        assert node_says in (node1.stdout.read() if node1.stdout else "")
    finally:
        end(node1)


@pytest.mark.slow  # two launches
def test_a_node_with_other_flags_is_refused(tiny_models: dict[str, Path]) -> None:
    refused_on_both_sides(
        tiny_models["llama"], _head, TP2, "other flags than rank 0", "other flags"
    )

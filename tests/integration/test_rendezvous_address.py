"""The address a GPU host registers, and the MASTER_ADDR a multi-node gang gets from it: a loopback
address the agent only resolved is refused in one line, one given on purpose is taken (every host
on one machine), a fleet mixing loopback and routable hosts is warned about, and a two-host gang's
rendezvous is rank 0's host's registered address."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _ledger_support import lose_silent_hosts

from gpusched.cli import main
from gpusched.commands.agent import host_address
from gpusched.errors import ConfigurationError
from gpusched.gang import GangMember, is_loopback, is_unspecified
from gpusched.hardware.detect import detect_backend
from gpusched.hardware.host_slice import HostSlice
from gpusched.ledger import Ledger
from gpusched.ledger.hosts import loopback_warning
from gpusched.placement import Policy
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide

FLEET = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets" / "multihost.yaml"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def ledger(url: str) -> Iterator[Ledger]:
    with Ledger(url) as led:
        led.migrate()
        yield led


@pytest.fixture
def resolves_to(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Make this host's name ``gpu-node-7`` resolve to the address the test sets."""
    monkeypatch.delenv("GPUSCHED_HOST_ADDRESS", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-7")

    def set_address(address: str) -> None:
        monkeypatch.setattr(socket, "gethostbyname", lambda name: address)

    yield set_address


def _register(ledger: Ledger, host: str, address: str) -> None:
    nodes = HostSlice(detect_backend("simulated", fleet=FLEET), host).discover()
    ledger.register_host(host, nodes, stale_after_s=10, address=address)


def _gang_envs(ledger: Ledger) -> dict[str, dict[str, str]]:
    """Place a two-node gang (one GPU per node) on the ledger's fleet: node -> member environment."""
    request = GPURequest.build(gpus=1, vendor="nvidia", interconnect="same_node")
    members = tuple(PendingWork(f"train__node{r}", request, 1.0, gang=GangMember("d/r/-1/train", 2, r))
                    for r in range(2))
    reply = decide(CycleRequest(members, ledger.snapshot(), Policy.named("gpusched"), (), 5.0,
                                QuotaState.unlimited(), addresses=ledger.node_addresses()))
    assert not reply.holds and len(reply.launches) == 2
    return {launch.shares[0].node: dict(launch.env) for launch in reply.launches}


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("localhost", True), ("LOCALHOST.", True), ("gpu.localhost", True),
    ("10.0.0.5", False), ("fe80::1", False), ("gpu-node-7", False), ("airflow-worker-gpu-host-a", False),
    ("0.0.0.0", False),
])
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_unspecified_addresses() -> None:
    assert is_unspecified("0.0.0.0") and is_unspecified("::") and is_unspecified("[::]")
    assert not is_unspecified("10.0.0.5") and not is_unspecified("gpu-node-7")


def test_a_resolved_loopback_address_is_refused_naming_the_fix(resolves_to: Callable[[str], None]) -> None:
    resolves_to("127.0.1.1")  # what Debian's /etc/hosts gives the host's name
    with pytest.raises(ConfigurationError) as refused:
        host_address(None)
    line = str(refused.value)
    assert "'gpu-node-7' resolves to the loopback address 127.0.1.1" in line
    assert "--address or GPUSCHED_HOST_ADDRESS" in line and "\n" not in line
    resolves_to("10.1.2.7")
    assert host_address(None) == "10.1.2.7"


def test_an_explicit_address_is_taken_as_given_unless_it_binds_everything(
    resolves_to: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    resolves_to("127.0.1.1")
    assert host_address("10.0.0.5") == "10.0.0.5"
    assert host_address("127.0.0.1") == "127.0.0.1"  # on purpose: every GPU host on this machine
    monkeypatch.setenv("GPUSCHED_HOST_ADDRESS", "gpu-node-7.cluster")
    assert host_address(None) == "gpu-node-7.cluster"
    assert host_address("10.0.0.5") == "10.0.0.5"  # the option wins over the variable
    for bind_all in ("0.0.0.0", "::"):
        with pytest.raises(ConfigurationError, match=f"--address {bind_all} is a bind address"):
            host_address(bind_all)


def test_the_agent_refuses_before_registering(
    url: str, resolves_to: Callable[[str], None], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    resolves_to("127.0.0.1")
    monkeypatch.setenv("GPUSCHED_NODE_NAME", "host-a")
    assert main(["agent", "--once", "--fleet", str(FLEET), "--db-url", url,
                 "--no-worker-watch", "--host-name", "host-a"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gpusched agent: error: this host's name 'gpu-node-7' resolves to the loopback")
    with Ledger(url) as ledger:
        ledger.migrate()
        assert ledger.hosts() == []


def test_two_agents_give_a_two_host_gang_rank_0s_address(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    addresses = {"host-a": "10.0.0.1", "host-b": "10.0.0.2"}
    for host, address in addresses.items():
        monkeypatch.setenv("GPUSCHED_NODE_NAME", host)
        assert main(["agent", "--once", "--fleet", str(FLEET), "--db-url", url,
                 "--no-worker-watch", "--host-name", host,
                     "--address", address]) == 0
        assert f"registered GPU host {host} at {address}" in capsys.readouterr().out
    with Ledger(url) as ledger:
        assert ledger.node_addresses() == addresses
        envs = _gang_envs(ledger)
    rank0 = next(node for node, env in envs.items() if env["NODE_RANK"] == "0")
    assert {env["MASTER_ADDR"] for env in envs.values()} == {addresses[rank0]}


def test_an_agent_warns_when_its_loopback_address_joins_routable_hosts(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUSCHED_NODE_NAME", "host-a")
    assert main(["agent", "--once", "--fleet", str(FLEET), "--db-url", url,
                 "--no-worker-watch", "--host-name", "host-a",
                 "--address", "10.0.0.1"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("GPUSCHED_NODE_NAME", "host-b")
    assert main(["agent", "--once", "--fleet", str(FLEET), "--db-url", url,
                 "--no-worker-watch", "--host-name", "host-b",
                 "--address", "127.0.0.1"]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gpusched agent: warning: GPU host(s) host-b (127.0.0.1) registered a loopback")
    assert "--address <the host's routable address>" in line
    assert main(["ledger", "hosts", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "at 10.0.0.1" in out and "at 127.0.0.1" in out and "warning: GPU host(s) host-b" in out


def test_loopback_warning_only_for_live_hosts_mixing_loopback_and_routable(ledger: Ledger) -> None:
    _register(ledger, "host-a", "127.0.0.1")
    assert loopback_warning(ledger.hosts()) is None  # one host
    _register(ledger, "host-b", "127.0.0.1")
    assert loopback_warning(ledger.hosts()) is None  # every host on one machine, on purpose
    envs = _gang_envs(ledger)
    assert {env["MASTER_ADDR"] for env in envs.values()} == {"127.0.0.1"}  # the local multi-host cluster
    _register(ledger, "host-b", "10.0.0.2")
    warning = loopback_warning(ledger.hosts())
    assert warning is not None and "host-a (127.0.0.1)" in warning and "host-b" not in warning
    assert "beside 1 routable host(s)" in warning
    lose_silent_hosts(ledger, 0, now=10**10)  # both silent: no live host left to warn about
    assert loopback_warning(ledger.hosts()) is None

"""Bootstrap addresses are parsed once, where they enter (the CLI, ``p2ptrain.DHT``, ``BlockingAverager``),
and go down as ``Multiaddr`` objects; ``$P2PTRAIN_BOOTSTRAP`` is read in one place, ``env_bootstrap``."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

import p2ptrain
from dht import DHTNode, Identity, Multiaddr, MultiaddrError
from p2ptrain.background import BOOTSTRAP_ENV
from p2ptrain.cli import main
from p2ptrain.cli.common import bootstrap_addrs

ROOT = Path(__file__).resolve().parent.parent
PID = Identity().peer_id
A, B, C, D = (f"/ip4/127.0.0.1/tcp/{port}/p2p/{PID}" for port in (1, 2, 3, 4))
LOOPBACK = ("127.0.0.1", 0)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No bootstrap or swarm key variables from outside, and no ./bootstrap_peers.txt."""
    monkeypatch.delenv(BOOTSTRAP_ENV, raising=False)
    monkeypatch.delenv("P2PTRAIN_SWARM_KEY_FILE", raising=False)
    monkeypatch.chdir(tmp_path)


def dht_loops() -> int:
    return sum(t.name == "p2ptrain-dht" for t in threading.enumerate())


def test_library_dht_given_a_bad_address_raises_one_line_before_starting():
    loops = dht_loops()
    with pytest.raises(MultiaddrError) as e:
        p2ptrain.DHT([A, "ip4/127.0.0.1/tcp/1"], listen=LOOPBACK)
    assert str(e.value).startswith("multiaddr 'ip4/127.0.0.1/tcp/1' must start with '/'") and "\n" not in str(e.value)
    assert dht_loops() == loops  # refused before its loop thread was started


def test_dht_without_initial_peers_joins_the_variables_peers_and_names_the_variable_when_bad(monkeypatch):
    monkeypatch.setenv(BOOTSTRAP_ENV, f"{A}, nonsense")
    with pytest.raises(MultiaddrError, match=r"^\$P2PTRAIN_BOOTSTRAP: multiaddr 'nonsense' must start with '/'"):
        p2ptrain.DHT(listen=LOOPBACK)
    with p2ptrain.DHT([], listen=LOOPBACK) as first:  # peers given (none): the variable is not read
        monkeypatch.setenv(BOOTSTRAP_ENV, str(first.multiaddrs[0]))
        with p2ptrain.DHT(listen=LOOPBACK) as second:  # as a script run by `p2ptrain peer --script`
            assert first.peer_id in second.node.routing


def test_blocking_averager_parses_its_peers_before_starting():
    import torch

    from p2ptrain.averaging import BlockingAverager

    with pytest.raises(MultiaddrError, match="'nonsense' must start with '/'"):
        BlockingAverager([torch.zeros(4)], "run", initial_peers=["nonsense"])


async def test_dht_node_takes_multiaddr_objects_not_text():
    node = DHTNode(listen=LOOPBACK)
    with pytest.raises(TypeError, match="Multiaddr.parse"):
        await node.start([A])
    assert node.multiaddrs == []  # refused before it listened
    await node.close()


def test_cli_bootstrap_is_the_flags_else_the_file_else_the_variable_else_bootstrap_peers_txt(tmp_path, monkeypatch):
    (tmp_path / "peers.txt").write_text(f"{B}\n")
    (tmp_path / "bootstrap_peers.txt").write_text(f"{D}\n")
    monkeypatch.setenv(BOOTSTRAP_ENV, C)
    a, b, c, d = map(Multiaddr.parse, (A, B, C, D))
    assert bootstrap_addrs([A], "peers.txt") == [a]
    assert bootstrap_addrs([a], None) == [a]  # parsed by `peer`'s config check: passed on as it is
    assert bootstrap_addrs(None, "peers.txt") == [b]
    assert bootstrap_addrs(None, None) == [c]
    monkeypatch.delenv(BOOTSTRAP_ENV)
    assert bootstrap_addrs(None, None) == [d]


@pytest.mark.parametrize("argv, env, needle", [
    (["dht", "get", "k", "--bootstrap", "nonsense"], None, "--bootstrap: multiaddr 'nonsense' must start with '/'"),
    (["dht", "get", "k"], "nonsense", "$P2PTRAIN_BOOTSTRAP: multiaddr 'nonsense' must start with '/'"),
    (["status"], f"{A} /ip4/1.2.3/tcp/1", "$P2PTRAIN_BOOTSTRAP: multiaddr '/ip4/1.2.3/tcp/1'"),
    (["peer"], "nonsense", "$P2PTRAIN_BOOTSTRAP: multiaddr 'nonsense' must start with '/'"),
])
def test_cli_bad_bootstrap_is_one_line_naming_where_it_came_from(argv, env, needle, monkeypatch, capsys):
    if env is not None:
        monkeypatch.setenv(BOOTSTRAP_ENV, env)
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_only_env_bootstrap_reads_the_variable():
    """The variable's name is code in two modules only: ``background`` (``BOOTSTRAP_ENV``, which
    ``env_bootstrap`` reads) and ``peer_cmd`` (which sets it for a ``--script``)."""
    def mentions(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value == BOOTSTRAP_ENV
        return (isinstance(node, ast.Name) and node.id == "BOOTSTRAP_ENV") or \
            (isinstance(node, ast.alias) and node.name == "BOOTSTRAP_ENV")

    found: dict[str, set[str]] = {}
    for path in sorted([*ROOT.glob("p2ptrain/**/*.py"), *ROOT.glob("dht/**/*.py")]):
        for node in filter(mentions, ast.walk(ast.parse(path.read_text()))):
            found.setdefault(path.relative_to(ROOT).as_posix(), set()).add(type(node).__name__)
    assert found == {"p2ptrain/background.py": {"Constant", "Name"}, "p2ptrain/cli/peer_cmd.py": {"alias", "Name"}}
    source = (ROOT / "p2ptrain/background.py").read_text()
    readers = [f.name for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef)
               and any(isinstance(n, ast.Name) and n.id == "BOOTSTRAP_ENV" for n in ast.walk(f))]
    assert readers == ["env_bootstrap"]

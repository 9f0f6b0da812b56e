"""Config for ``p2ptrain peer``/``swarm``: TOML file < ``P2PTRAIN_*`` variables < flags, and one-line errors.

Most cases run ``p2ptrain.cli.main`` in-process (an error stops before anything starts); one case
drives the command in a subprocess, as a user would, for the exit code and the absence of a traceback.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dht import Identity, Multiaddr
from p2ptrain.cli import build_parser, main
from p2ptrain.config import apply_config

A = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWBtg3aaGc3bB8PxW4hbMHHzqDtdqdyiAMtoWDjuhzZAXv"
B = "/ip4/127.0.0.1/tcp/4002/p2p/12D3KooWBtg3aaGc3bB8PxW4hbMHHzqDtdqdyiAMtoWDjuhzZAXv"
MA, MB = Multiaddr.parse(A), Multiaddr.parse(B)  # the config check parses bootstrap addresses, once


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No P2PTRAIN_* variables from the outside, and a scratch working directory."""
    import os

    for name in list(os.environ):
        if name.startswith("P2PTRAIN_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def resolve(argv: list[str], env: dict[str, str] | None = None):
    args = build_parser().parse_args(argv)
    sources = apply_config(args, build_parser, argv, env or {})
    return args, sources


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    write(tmp_path / "run.toml", f"""
        epochs = 5
        target_batch_size = 256
        example = "char_lm"
        bootstrap = ["{A}"]
        compute-delay = 1          # hyphens as in the flag work too; an int for a float flag is fine
        delay_updates = true
        key_file = "keys/peer.key" # relative to the file
    """)
    (tmp_path / "keys").mkdir()
    env = {"P2PTRAIN_EPOCHS": "7", "P2PTRAIN_BOOTSTRAP": f"{B}, {A}", "P2PTRAIN_MODE": "diloco",
           "P2PTRAIN_UNRELATED": "ignored"}
    args, sources = resolve(["peer", "--config", "run.toml", "--epochs", "9"], env)
    assert args.epochs == 9 and sources["epochs"] == "--epochs"  # flag > env > file
    assert args.mode == "diloco" and sources["mode"] == "$P2PTRAIN_MODE"  # env > default
    assert args.bootstrap == [MB, MA] and sources["bootstrap"] == "$P2PTRAIN_BOOTSTRAP"  # env > file
    assert args.target_batch_size == 256 and args.example == "char_lm" and sources["example"] == "run.toml"
    assert args.compute_delay == 1.0 and isinstance(args.compute_delay, float) and args.delay_updates is True
    assert args.key_file == str(tmp_path / "keys" / "peer.key")
    assert args.lr is None and args.seed == 0  # defaults where nobody said anything

    args, _ = resolve(["peer", "--config", "run.toml"], env)
    assert args.epochs == 7  # env > file
    args, _ = resolve(["peer", "--config", "run.toml", "--epochs", "40"], env)
    assert args.epochs == 40  # a flag wins even when it repeats the default
    args, _ = resolve(["peer", "--config", "run.toml"])
    assert args.epochs == 5 and args.bootstrap == [MA]  # file > default


def test_bootstrap_and_bootstrap_file_are_one_setting(tmp_path):
    write(tmp_path / "run.toml", f'bootstrap = ["{A}"]\n')
    write(tmp_path / "peers.txt", f"{B}\n")
    args, _ = resolve(["peer", "--config", "run.toml", "--bootstrap-file", "peers.txt"])
    assert args.bootstrap is None and args.bootstrap_file == "peers.txt"  # the flag beats the file's list
    args, _ = resolve(["peer", "--config", "run.toml"], {"P2PTRAIN_BOOTSTRAP_FILE": "peers.txt"})
    assert args.bootstrap is None and args.bootstrap_file == "peers.txt"  # so does the variable


def test_config_reaches_the_peer_config_and_swarm_forwards_it(tmp_path, monkeypatch):
    from p2ptrain.cli.peer_cmd import _config, training_argv

    write(tmp_path / "run.toml", 'target_batch_size = 128\nthreads = 1\nlr = 0.01\nrun_id = "my-run"\n')
    args, _ = resolve(["peer", "--config", "run.toml", "--bootstrap", A])
    cfg = _config(args)
    assert (cfg.target_batch_size, cfg.threads, cfg.lr, cfg.run_id,
            list(cfg.bootstrap)) == (128, 1, 0.01, "my-run", [MA])

    monkeypatch.setenv("P2PTRAIN_EPOCHS", "7")
    args, _ = resolve(["swarm", "--config", "run.toml", "--epochs", "40"], {"P2PTRAIN_EPOCHS": "7"})
    argv = training_argv(args)
    assert "--config" not in argv
    assert argv[argv.index("--target-batch-size") + 1] == "128"
    assert argv[argv.index("--epochs") + 1] == "40"  # the child inherits $P2PTRAIN_EPOCHS: the flag must win there too


ERRORS = [
    # (run.toml, env, extra argv, what the one line must say)
    ("target_batchsize = 512\n", {}, [], "run.toml: unknown key 'target_batchsize' "
     "(did you mean 'target_batch_size'?)"),
    ('epochs = "50"\n', {}, [], "run.toml: epochs: expected an integer, got a string ('50')"),
    ("epochs = true\n", {}, [], "run.toml: epochs: expected an integer, got a boolean (True)"),
    ("lr = \"fast\"\n", {}, [], "run.toml: lr: expected a number"),
    ('example = "mnist"\n', {}, [], "run.toml: example: 'mnist' is not one of digits, char_lm"),
    ("bootstrap = [1]\n", {}, [], "run.toml: bootstrap: expected a list of strings"),
    ('bootstrap = ["/ip4/1.2.3/tcp/1"]\n', {}, [], "run.toml: bootstrap: "),
    ('listen = "/dns4/example.com/tcp/1"\n', {}, [], "listen on an IP address"),
    ("[peer]\nepochs = 3\n", {}, [], "run.toml: [peer]: tables are not used"),
    ("epochs = \n", {}, [], "run.toml: not valid TOML"),
    ("", {"P2PTRAIN_EPOCHS": "many"}, [], "$P2PTRAIN_EPOCHS: expected an integer, got 'many'"),
    ("", {"P2PTRAIN_BOOTSTRAP": "ip4/127.0.0.1/tcp/1"}, [], "$P2PTRAIN_BOOTSTRAP: "),
    ("", {"P2PTRAIN_DELAY_UPDATES": "maybe"}, [], "$P2PTRAIN_DELAY_UPDATES: expected true or false"),
    ('key_file = "bad.key"\n', {}, [], "run.toml: key_file: key file"),
    ('key_file = "run.toml/peer.key"\n', {}, [], "run.toml is not a directory"),
    ("", {}, ["--key-file", "."], "--key-file: cannot read key file"),
    ("", {}, ["--metrics-port", "70000"], "--metrics-port must be between 0 and 65535"),
    ('compression = "topk"\naggregation = "median"\n', {}, [], "run.toml: aggregation: aggregation 'median' cannot "
     "combine 'topk' parts"),
    ("", {}, ["--listen", "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA/p2p-circuit"
              "/p2p/12D3KooWQXRfbfuE3BJJNkgCQ3VMFVtT7n4kGfJrc5oFKqFvgQ9T"],
     "--listen: a /p2p-circuit address is reached"),
]


@pytest.mark.parametrize("toml, env, extra, needle", ERRORS)
def test_bad_config_is_one_line_error_naming_the_field(toml, env, extra, needle, tmp_path, monkeypatch, capsys):
    write(tmp_path / "run.toml", toml)
    (tmp_path / "bad.key").write_bytes(b"not a key")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["peer", "--config", "run.toml", *extra]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2ptrain: error: ") and needle in lines[0], err


def test_missing_file_and_keys_of_another_command(tmp_path, capsys):
    assert main(["peer", "--config", "nowhere.toml"]) == 2
    assert "nowhere.toml: cannot read the config file: No such file or directory" in capsys.readouterr().err
    write(tmp_path / "swarm.toml", f'peers = 2\nbootstrap = ["{A}"]\n')
    assert main(["swarm", "--config", "swarm.toml"]) == 2
    assert "swarm.toml: key 'bootstrap' does not apply to 'p2ptrain swarm'" in capsys.readouterr().err


def test_metrics_port_in_use_and_unwritable_round_log(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["peer", "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--epochs", "1"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"--metrics-port {port}" in lines[0] and "in use" in lines[0], lines
    assert main(["peer", "--round-log", str(tmp_path / "no" / "rounds.jsonl"), "--epochs", "1"]) == 2
    assert "--round-log" in capsys.readouterr().err


def test_a_user_gets_one_line_and_exit_2(tmp_path):
    """The same, as a user sees it: a real process, no traceback."""
    write(tmp_path / "run.toml", "target_batchsize = 512\n")
    for cmd in ("peer", "swarm"):
        out = subprocess.run([sys.executable, "-m", "p2ptrain", cmd, "--config", "run.toml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr == ("p2ptrain: error: run.toml: unknown key 'target_batchsize' "
                              "(did you mean 'target_batch_size'?)\n")


def test_existing_key_file_is_accepted(tmp_path):
    key = tmp_path / "peer.key"
    Identity().save(key)
    args, _ = resolve(["peer", "--key-file", str(key)])
    assert args.key_file == str(key)


def test_group_size_and_mixing_reach_the_peer_config_and_the_peers_a_swarm_starts(tmp_path, capsys):
    """``--target-group-size`` and ``--no-mixing`` (flags, variables or the file) reach the optimizer's
    options, and ``p2ptrain swarm`` passes them on to each peer it starts."""
    from dht import ConfigError
    from p2ptrain.cli.peer_cmd import _config, check_training_args, training_argv

    for cmd in ("peer", "swarm"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--target-group-size N" in text and "--no-mixing" in text
    cfg = _config(resolve(["peer", "--bootstrap", A])[0])
    assert (cfg.target_group_size, cfg.mixing) == (16, True)
    cfg = _config(resolve(["peer", "--bootstrap", A, "--target-group-size", "4", "--no-mixing"])[0])
    assert (cfg.target_group_size, cfg.mixing) == (4, False)
    write(tmp_path / "run.toml", "target_group_size = 8\n")
    args, sources = resolve(["swarm", "--config", "run.toml"], {"P2PTRAIN_NO_MIXING": "1"})
    assert sources["target_group_size"] == "run.toml" and sources["no_mixing"] == "$P2PTRAIN_NO_MIXING"
    argv = training_argv(args)
    assert argv[argv.index("--target-group-size") + 1] == "8" and "--no-mixing" in argv
    with pytest.raises(ConfigError, match="--target-group-size must be at least 1"):
        check_training_args(resolve(["peer", "--target-group-size", "0"])[0])

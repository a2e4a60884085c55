"""The ssh command line, the probe's parsing, interface choice and the mpirun command."""

from __future__ import annotations

import pytest

from hora.errors import LaunchError
from hora.launch import mpirun
from hora.launch.config import LaunchConfig
from hora.launch.hosts import assign_ranks, parse_hosts
from hora.launch.preflight import choose_interfaces
from hora.launch.ssh import SshOptions, parse_probe, remote_argv


def test_ssh_argv() -> None:
    argv = SshOptions(port=2222, identity_file="/k", config_file="/cfg").argv("hostA")
    assert argv[:5] == ["ssh", "-o", "PasswordAuthentication=no", "-o",
                        "StrictHostKeyChecking=no"]  # fmt: skip
    assert argv[-7:] == ["-F", "/cfg", "-p", "2222", "-i", "/k", "hostA"]
    assert SshOptions().argv("h")[-1] == "h" and "-p" not in SshOptions().argv("h")


def test_remote_argv_quotes_the_script() -> None:
    argv = remote_argv(SshOptions(), "h", "echo 'a b'; exit 3")
    assert argv[-1] == "sh -c 'echo '\"'\"'a b'\"'\"'; exit 3'"


def test_parse_probe() -> None:
    out = (
        "Welcome!\nhora-probe 10.77.0.1 51234 10.77.0.2 22\n"
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n"
        "2: eth0@if5    inet 10.77.0.2/24 brd 10.77.0.255 scope global eth0\n"
    )
    result = parse_probe("hostA", out)
    assert result.launcher_address == "10.77.0.1"
    assert result.interfaces == {"lo": ["127.0.0.1"], "eth0": ["10.77.0.2"]}
    with pytest.raises(LaunchError, match="SSH_CONNECTION"):
        parse_probe("hostA", "nothing\n")


HOSTS = {
    "a": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.1"], "ib0": ["10.1.0.1"]},
    "b": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"], "ib0": ["10.1.0.2"]},
    "c": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.3"]},
}


def test_choose_interfaces() -> None:
    chosen, why = choose_interfaces({k: HOSTS[k] for k in "ac"}, [], True)
    assert chosen == ["eth0"] and "only interface" in why
    chosen, why = choose_interfaces({k: HOSTS[k] for k in "ab"}, [], True)
    assert chosen == ["eth0", "ib0"] and "alphabetical" in why
    chosen, why = choose_interfaces({"localhost": HOSTS["a"]}, [], False)
    assert chosen == ["lo"]
    assert choose_interfaces({k: HOSTS[k] for k in "ab"}, ["ib0"], True) == (
        ["ib0"], "given by --network-interfaces"
    )  # fmt: skip
    with pytest.raises(LaunchError, match=r"ib0 \(missing on c\)"):
        choose_interfaces(HOSTS, ["ib0"], True)
    assert choose_interfaces({"a": {"x": ["1.1.1.1"]}, "b": {"y": ["1.1.1.2"]}}, [], True)[0] == []


def test_mpirun_command_forwards_names_not_values() -> None:
    cfg = LaunchConfig(command=["python", "t.py"], np=3, mpi_args="--mca foo 1",
                       output_filename="logs")  # fmt: skip
    slots = assign_ranks(parse_hosts("a:2,b:2"), 3)
    env = {"HORA_SECRET_KEY": "deadbeef", "PATH": "/bin"}
    argv = mpirun.command(cfg, slots, env, SshOptions(port=22), ["eth0"], mpirun="mpirun")
    head = "mpirun --allow-run-as-root --tag-output -np 3 -H a:2,b:1 -bind-to none -map-by slot"
    assert argv[:11] == head.split()
    assert "btl_tcp_if_include" in argv and "eth0" in argv
    assert argv[argv.index("plm_rsh_args") + 1] == "-p 22"
    assert argv[argv.index("HORA_SECRET_KEY") - 1 :][:2] == ["-x", "HORA_SECRET_KEY"]
    assert "deadbeef" not in " ".join(argv)
    assert argv[-4:] == ["foo", "1", "python", "t.py"]
    assert argv[argv.index("--output-filename") + 1] == "logs"
    binding = "--bind-to core --map-by socket"
    bound = LaunchConfig(command=["python", "t.py"], np=3, binding_args=binding)
    argv = mpirun.command(bound, slots, env, SshOptions(port=22), [], mpirun="mpirun")
    assert argv[7:11] == ["--bind-to", "core", "--map-by", "socket"]
    assert "-bind-to" not in argv and "slot" not in argv


def test_store_listens_on_loopback_locally_and_on_the_job_address_across_hosts() -> None:
    from hora.launch.preflight import Preflight

    local = Preflight({"localhost": "127.0.0.1"}, ["lo"], "")
    assert local.store_bind_address() == "127.0.0.1"
    assert local.store_bind_address(listen_any=True) == "0.0.0.0"
    assert local.store_bind_address(open_ended=True) == "0.0.0.0"  # elastic: hosts join later
    multi = Preflight({"localhost": "127.0.0.1", "b": "10.1.0.1", "c": "10.1.0.1"}, ["eth0"], "")
    assert multi.store_bind_address() == "10.1.0.1"
    # the ranks on the launcher's host reach the store at that address too
    assert multi.launcher_address == {"localhost": "10.1.0.1", "b": "10.1.0.1", "c": "10.1.0.1"}
    split = Preflight({"b": "10.1.0.1", "c": "10.2.0.1"}, [], "")
    assert split.store_bind_address() == "0.0.0.0"  # no one address serves both: said in a warning


def test_ssh_sessions_of_a_vanished_host_end() -> None:
    """Keepalives: a host whose network is gone ends its ssh sessions (its ranks then count as
    failed) instead of leaving them open for ever."""
    argv = " ".join(SshOptions().argv("h"))
    assert "-o ServerAliveInterval=5 -o ServerAliveCountMax=3" in argv

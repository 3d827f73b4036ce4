"""Ports for local children are chosen where the kernel never hands out ports itself."""

from __future__ import annotations

import socket

from pdpool.ports import candidate_ports, ephemeral_range, free_port, free_ports, listen_error


def test_chosen_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    lo, hi = ephemeral_range()
    ports = free_ports(20) + [free_port() for _ in range(20)]
    assert len(set(ports)) == 40  # never the same twice in a process
    for port in ports:
        assert not lo <= port <= hi
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_held_port_is_not_chosen():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        assert taken not in free_ports(50)


def test_candidates_leave_out_the_ephemeral_range(tmp_path):
    path = tmp_path / "range"
    path.write_text("20000\t30000\n")
    span = ephemeral_range(str(path))
    assert span == (20000, 30000)
    candidates = candidate_ports(span)
    assert 19999 in candidates and 30001 in candidates
    assert not any(20000 <= p <= 30000 for p in candidates)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_listen_error_names_a_held_port_and_passes_a_free_one():
    assert listen_error("127.0.0.1", 0) is None
    assert listen_error("127.0.0.1", free_port()) is None
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))  # every address: 127.0.0.1's port is taken too
        held.listen()
        port = held.getsockname()[1]
        error = listen_error("127.0.0.1", port)
    assert error is not None and error.startswith(f"cannot listen on 127.0.0.1:{port}: ")

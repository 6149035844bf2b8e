"""The process at the other end of a loopback connection is proven from the kernel's socket table: the
pid that holds the client socket owns it; any other pid (a parent, a stranger, init) does not."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from parwatch.sidecar.pid_owner import Connection, owns_connection, socket_inode


def test_the_connecting_process_owns_its_connection_and_no_other_does():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, peer = server.accept()
        try:
            assert peer == client.getsockname()
            assert socket_inode(*peer) == os.fstat(client.fileno()).st_ino
            assert owns_connection(os.getpid(), peer)
            assert not owns_connection(os.getppid(), peer) and not owns_connection(1, peer)
            assert not owns_connection(os.getpid(), None) and not owns_connection(os.getpid(), ("127.0.0.1", 1))
        finally:
            accepted.close()
            client.close()


def test_a_child_that_connects_owns_its_connection_and_the_parent_does_not():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                (f"import socket, sys\ns = socket.create_connection(('127.0.0.1', {port}))\nsys.stdin.read()\n"),
            ],
            stdin=subprocess.PIPE,
        )
        try:
            accepted, peer = server.accept()
            assert owns_connection(child.pid, peer)
            assert not owns_connection(os.getpid(), peer)
            accepted.close()
        finally:
            child.stdin.close()
            child.wait(10)


def test_an_ipv6_loopback_connection():
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with server:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, peer = server.accept()
        try:
            assert owns_connection(os.getpid(), peer[:2])
        finally:
            accepted.close()
            client.close()


def test_a_closed_socket_of_the_same_address_is_not_taken_for_the_live_one(tmp_path):
    """Found by CI: an earlier connection's TIME_WAIT entry (inode 0) with the same ephemeral port came first
    in the table and was returned; only a socket a process holds has an inode."""
    table = tmp_path / "tcp"
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   {sl}: 0100007F:B7B2 0100007F:A4C1 {st} 00000000:00000000 00:00000000 00000000     0        0 {inode}\n"
    table.write_text(header + row.format(sl=0, st="06", inode=0) + row.format(sl=1, st="01", inode=713250))
    assert socket_inode("127.0.0.1", 0xB7B2, tables=(str(table),)) == 713250


def test_one_port_shared_by_two_processes_connections_to_two_servers_names_each_owner():
    """Found by CI: Linux gives one ephemeral port to connections to different destinations, so a rank's own
    post was refused as another process's (whose socket to elsewhere had the same local port came first in
    the table). The sidecar's end of the connection tells them apart."""
    with socket.create_server(("127.0.0.1", 0)) as ours, socket.create_server(("127.0.0.1", 0)) as theirs:
        child = subprocess.Popen(
            [sys.executable, "-c", (
                "import socket, sys\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                f"s.bind(('127.0.0.1', 0))\nprint(s.getsockname()[1], flush=True)\n"
                f"s.connect(('127.0.0.1', {theirs.getsockname()[1]}))\nsys.stdin.read()\n")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            port = int(child.stdout.readline())
            theirs.accept()[0].close()
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            client.bind(("127.0.0.1", port))
            client.connect(ours.getsockname())
            accepted, peer = ours.accept()
            assert peer == ("127.0.0.1", port)
            mine = Connection("127.0.0.1", port, ours.getsockname())
            elsewhere = Connection("127.0.0.1", port, theirs.getsockname())
            assert owns_connection(os.getpid(), mine) and not owns_connection(child.pid, mine)
            assert owns_connection(child.pid, elsewhere) and not owns_connection(os.getpid(), elsewhere)
            accepted.close()
            client.close()
        finally:
            child.stdin.close()
            child.wait(10)

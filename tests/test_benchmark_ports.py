"""Benchmarks' ranks meet on a port the kernel picked free (``benchmarks/harness/ports.py``), never a fixed or
random one: two benchmarks started together on one machine never collide."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from benchmarks.harness.ports import free_port

pytestmark = pytest.mark.fast

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
#: a line naming a port (``port``, ``MASTER_PORT``, ``init_method=tcp://...:``) with a random pick or a
#: literal
_PICKED = re.compile(r"(\bport\b|_port\b|MASTER_PORT|tcp://)[^#\n]*(randint\(|randrange\(|\b\d{4,5}\b)", re.I)


def test_a_free_port_binds_and_two_picks_held_at_once_differ():
    with socket.socket() as a, socket.socket() as b:
        pa = free_port()
        a.bind(("127.0.0.1", pa))
        pb = free_port()  # while the first is bound: the kernel never hands it out again
        b.bind(("127.0.0.1", pb))
        assert pa != pb and all(1024 <= p < 65536 for p in (pa, pb))


def test_no_benchmark_picks_a_fixed_or_random_port():
    found = [f"{path.relative_to(BENCHMARKS)}:{i}: {line.strip()}"
             for path in sorted(BENCHMARKS.rglob("*.py"))
             if path != BENCHMARKS / "harness" / "ports.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if _PICKED.search(line)]
    assert not found, "pick the port with benchmarks.harness.ports.free_port():\n" + "\n".join(found)

"""The TCP port a benchmark's ranks meet on: one the kernel picked free (bound to port 0), never a fixed or
random one (a fixed port collided with another run on a shared machine; a random one in 20000-40000 with
a port in use there: ``EADDRINUSE``, or ranks joining another benchmark's store)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on now (the kernel's pick for a bind to port 0; released
    again for the ranks to bind: another process could take it in between, far less likely than a random
    pick colliding)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

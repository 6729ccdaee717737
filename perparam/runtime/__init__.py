"""The runtime: sharded parameters, groups and their states, the per-root iteration context, the hooks that
decide when collectives run, casts, precision islands and what a user registered before sharding.
Imports ``perparam.sharding`` and ``perparam.comm``; the face (``perparam.api``, ``perparam.module``, ...)
is above it."""

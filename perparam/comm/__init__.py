"""The communication floor: the only place collectives are issued (``collectives``), their transient
buffers (``buffers``), the reduction process groups (``process_groups``) and the debug checks (``debug``).
Imports ``perparam.sharding`` at most."""

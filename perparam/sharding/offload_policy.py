"""``OffloadPolicy`` (where one parameter's persistent state lives: device, host memory or disk) and
``as_offload``, its checks; ``PolicyError``, what a policy that cannot apply raises. Re-exported by
``perparam.sharding.policy``."""

from __future__ import annotations

from dataclasses import dataclass


class PolicyError(ValueError):
    """A policy that cannot apply to a parameter; the message names the parameter and the fix."""


#: where a parameter's persistent state can live (``OffloadPolicy.tier``)
TIERS = ("device", "cpu", "disk")
#: which of its persistent state goes there (``OffloadPolicy.state``)
STATES = ("optimizer", "all")


@dataclass(frozen=True)
class OffloadPolicy:
    """Where one parameter's persistent state lives between uses (ZeRO-Offload, ZeRO-Infinity).

    ``tier``: ``"device"`` (the mesh's device: no offload), ``"cpu"`` (host memory: on a CPU mesh the same
    memory as ``"device"``, accepted so a policy runs on both; on a CUDA mesh pinned host memory when
    ``pin_memory``), ``"disk"`` (files in a folder of ``path``, read ahead on a background thread before
    use and written back after the optimizer step). ``state``: ``"optimizer"`` (the optimizer's state
    tensors only: two fp32 tensors per parameter under Adam, most of the bytes) or ``"all"`` (also the
    stored shard and its gradient). ``path``: the folder (needed by ``"disk"``; ``perparam`` makes a
    scratch folder inside it per process, removed at exit; stale ones of a killed run are removed at the
    next start). FSDP2's ``CPUOffloadPolicy(pin_memory=...)`` is ``OffloadPolicy("cpu", "all",
    pin_memory=...)``; ``fully_shard(offload_policy=...)`` accepts either.
    """

    tier: str = "device"
    state: str = "optimizer"
    path: str | None = None
    pin_memory: bool = True

    @property
    def offloaded(self) -> bool:
        """Whether anything leaves the device memory (``tier`` other than ``"device"``)."""
        return self.tier != "device"


def as_offload(value, what: str) -> OffloadPolicy | None:
    """``value`` as an ``OffloadPolicy``: one itself, ``None``, a tier name (``"device"``, ``"cpu"``;
    ``"disk"`` needs ``OffloadPolicy("disk", path=...)``), or torch's FSDP2 ``OffloadPolicy`` /
    ``CPUOffloadPolicy``. Raises ``PolicyError`` naming ``what`` otherwise."""
    if value is None or isinstance(value, OffloadPolicy):
        policy = value
    elif isinstance(value, str):
        policy = OffloadPolicy(value)
    elif type(value).__name__ == "CPUOffloadPolicy":  # torch's FSDP2 spelling, without importing FSDP
        policy = OffloadPolicy("cpu", "all", pin_memory=bool(getattr(value, "pin_memory", True)))
    elif type(value).__name__ == "OffloadPolicy":
        policy = OffloadPolicy()
    else:
        raise PolicyError(f"{what} must be a perparam OffloadPolicy, a tier name {TIERS} or torch's "
                          f"CPUOffloadPolicy, got {value!r}")
    if policy is None:
        return None
    if policy.tier not in TIERS:
        raise PolicyError(f"{what} has tier {policy.tier!r}; use one of {TIERS}")
    if policy.state not in STATES:
        raise PolicyError(f"{what} has state {policy.state!r}; use 'optimizer' (optimizer state only) or "
                          "'all' (stored shard, gradient and optimizer state)")
    if not isinstance(policy.pin_memory, bool):
        raise PolicyError(f"{what} has pin_memory={policy.pin_memory!r}; pass True or False")
    if policy.tier == "disk" and not policy.path:
        raise PolicyError(f"{what} puts state on disk but names no folder: pass "
                          "OffloadPolicy('disk', path='/a/fast/local/disk')")
    return policy

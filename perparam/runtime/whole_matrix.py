"""The whole-matrix optimizers from outside torch that perparam recognises by name
(``owner_step.is_whole_matrix`` asks here): the classes users reach through transformers, matched along an
optimizer's class hierarchy so no package is imported to recognise them, and which of their parameter groups
they step whole. A leaf."""

from __future__ import annotations

import torch

__all__ = ["KNOWN", "known", "steps_whole"]

#: the whole-matrix optimizers outside torch that users reach through transformers (``TrainingArguments(optim=
#: "adafactor" | "galore_*" | "apollo_*" | "stable_adamw")`` and ``transformers.optimization``), by the module
#: that defines the class and its name, matched along the optimizer's class hierarchy (nothing is imported to
#: recognise them), each with the parameter-group key that marks the groups it steps whole (``None``: every
#: group)
KNOWN: dict[str, str | None] = {
    # factored second moment (row and column means of the squared gradient), the update's RMS clipped, the
    # step scaled by the parameter's RMS
    "transformers.optimization.Adafactor": None,
    "galore_torch.adafactor.Adafactor": None,
    # GaLore, APOLLO: the gradient of each matrix of a group with a projection ``rank`` projected (an SVD, a
    # random projection of the whole matrix); the other groups are stepped elementwise
    "galore_torch.adamw.AdamW": "rank",
    "galore_torch.adamw8bit.AdamW8bit": "rank",
    "apollo_torch.apollo.AdamW": "rank",
    "apollo_torch.q_apollo.AdamW": "rank",
    # StableAdamW: each tensor's learning rate divided by the RMS of its whole update ratio
    "optimi.stableadamw.StableAdamW": None,
}


def known(cls: type) -> tuple[bool, str | None]:
    """``(known, group key)`` of ``cls`` in ``KNOWN`` (by its own or an ancestor's name)."""
    for c in cls.__mro__:
        name = f"{c.__module__}.{c.__qualname__}"
        if name in KNOWN:
            return True, KNOWN[name]
    return False, None


def steps_whole(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether a whole-matrix ``optimizer`` steps the parameters of ``group`` (one of its ``param_groups``)
    whole: every group, except for a ``KNOWN`` class that projects only the groups with its key."""
    key = known(type(optimizer))[1]
    return key is None or key in group

"""``perparam plan --param-policy 'PATTERN=TOKEN,TOKEN,...'``: per-parameter policies on the command line.

One flag per pattern (fnmatch on the names ``named_parameters`` gives, first match wins, as
``fully_shard``'s mapping). Tokens, comma-separated, any order:

===================  ===================================================================
``fp32|bf16|fp16``   ``param_dtype`` (compute and all-gather dtype)
``reduce=DTYPE``     ``reduce_dtype``
``master=DTYPE``     ``master_dtype`` (the stored dtype of the shard)
``frozen``           ``requires_grad=False`` (no gradient, no optimizer state)
``int8|fp8|nf4``     quantized all-gather (``QuantPolicy(name)``)
``stored``           with a quantizer: keep the (frozen) shard quantized (``store_quantized=True``)
``replicate``        ``placement=Replicate()``
``shardD``           ``placement=Shard(D)``, e.g. ``shard1``
``auto``             ``placement="auto"`` (``perparam.sharding.placement``)
``stageN``           ``zero_stage=N`` (1, 2 or 3; ``ParamPolicy.zero_stage``), e.g. ``stage2``
``grad=int8|bf16``   ``grad_quant``: the gradient reduce-scatter's wire format (ZeRO++ qgZ)
===================  ===================================================================

``--zero-stage N`` gives every parameter whose pattern names no stage (and every parameter no pattern
matches) stage N, as passing ``ParamPolicy(zero_stage=N)`` call-wide does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from perparam.sharding import quant, quant_nf4  # noqa: F401 (importing quant_nf4 registers "nf4")
from perparam.sharding.policy import ParamPolicy, QuantPolicy

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
QUANTIZERS = tuple(quant.names())  # the registry's (``perparam.quant``)


def parse_param_policy(spec: str) -> tuple[str, ParamPolicy]:
    """``"PATTERN=TOKENS"`` -> ``(pattern, ParamPolicy)``. Raises ``ValueError`` naming the bad token."""
    pattern, sep, tokens = spec.partition("=")
    if not sep or not pattern or not tokens:
        raise ValueError(f"--param-policy {spec!r}: expected PATTERN=TOKEN[,TOKEN...], e.g. "
                         "'*.mlp.*=bf16,int8'")
    fields: dict = {}
    quantizer, stored = None, False
    for token in tokens.split(","):
        token = token.strip()
        key, _, value = token.partition("=")
        if token in DTYPES:
            fields["param_dtype"] = DTYPES[token]
        elif key == "grad" and value in ("int8", "bf16"):
            fields["grad_quant"] = value
        elif key in ("reduce", "master") and value in DTYPES:
            fields[f"{key}_dtype"] = DTYPES[value]
        elif token == "frozen":
            fields["requires_grad"] = False
        elif token == "owner":
            fields["update"] = "owner"  # one rank steps the whole tensor (Muon, Adafactor)
        elif token in QUANTIZERS:
            quantizer = token
        elif token == "stored":
            stored = True
        elif token == "replicate":
            fields["placement"] = Replicate()
        elif token == "auto":
            fields["placement"] = "auto"
        elif token.startswith("shard") and token[5:].isdigit():
            fields["placement"] = Shard(int(token[5:]))
        elif token.startswith("stage") and token[5:].isdigit():
            fields["zero_stage"] = int(token[5:])  # 1, 2, 3: checked where fully_shard checks it
        else:
            raise ValueError(f"--param-policy {spec!r}: unknown token {token!r}; use fp32/bf16/fp16, "
                             f"reduce=DTYPE, master=DTYPE, frozen, owner, {'/'.join(QUANTIZERS)}, stored, "
                             "replicate, shardD, auto, stageN, grad=int8/bf16")
    if stored and quantizer is None:
        raise ValueError(f"--param-policy {spec!r}: 'stored' needs a quantizer token "
                         f"({', '.join(QUANTIZERS)})")
    if quantizer is not None:
        fields["quant"] = QuantPolicy(quantizer, store_quantized=stored)
    return pattern, ParamPolicy(**fields)


def policy_mapping(specs: list[str], placement: str = "shard0",
                   zero_stage: int | None = None) -> dict[str, ParamPolicy] | None:
    """The ``param_policy`` mapping of the ``--param-policy`` flags; ``placement="auto"`` adds a catch-all
    ``"*": ParamPolicy(placement="auto")`` and makes every pattern without a placement auto too;
    ``zero_stage`` (``--zero-stage``) likewise gives its stage to every pattern without one, and to the
    catch-all."""
    mapping = dict(parse_param_policy(s) for s in specs)
    defaults = {"placement": "auto"} if placement == "auto" else {}
    if zero_stage is not None:
        defaults["zero_stage"] = zero_stage
    if defaults:
        mapping = {k: ParamPolicy(**{**v.__dict__, **{f: d for f, d in defaults.items()
                                                      if getattr(v, f) is None}}) for k, v in mapping.items()}
        mapping.setdefault("*", ParamPolicy(**defaults))
    return mapping or None


def policy_from_args(specs: list[str], placement: str = "shard0", factory: str | None = None,
                     zero_stage: int | None = None):
    """``perparam plan``'s ``param_policy``: the ``--param-policy-factory`` function's result (imported as
    ``--model`` imports, ``perparam.memory.plan.import_object``), then the ``--param-policy`` flags.

    A factory's mapping comes first, so its patterns win (first match wins); flags add patterns after it. A
    factory returning a ``ParamPolicy`` or a callable cannot be combined with flags or ``--placement auto``.
    Raises ``ValueError``/``TypeError`` naming the flag."""
    flags = policy_mapping(specs, placement, zero_stage)
    if factory is None:
        return flags
    from collections.abc import Mapping

    from perparam.memory.plan import import_object

    policy = import_object(factory, "--param-policy-factory", "package.module:function")()
    if isinstance(policy, Mapping):
        bad = next((k for k, v in policy.items()
                    if not isinstance(k, str) or not isinstance(v, ParamPolicy)), None)
        if bad is not None:
            raise TypeError(f"--param-policy-factory {factory}: the dict must map glob patterns (str) to "
                            f"ParamPolicy; entry {bad!r} does not")
        return {**policy, **{k: v for k, v in (flags or {}).items() if k not in policy}}
    if not (isinstance(policy, ParamPolicy) or callable(policy)):
        raise TypeError(f"--param-policy-factory {factory} returned {type(policy).__name__}; it must return "
                        "a dict of patterns to ParamPolicy, a ParamPolicy or a callable (name, param) -> "
                        "ParamPolicy | None")
    if flags:
        raise ValueError(f"--param-policy-factory {factory} returned a {type(policy).__name__}, which cannot "
                         "be combined with --param-policy or --placement auto; return a dict instead")
    return policy

"""The one place a parameter's ``ParamPolicy`` is picked from a call's ``param_policy`` (a mapping of name
patterns, a callable or one policy): ``pick_policy``, and ``check_patterns`` (a pattern matching no
parameter is refused). ``resolution.resolve_param`` picks; ``policy.resolve`` takes what it picked."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

from .offload_policy import PolicyError
from .policy import ParamPolicy


def pick_policy(name: str, param, param_policy, names: Sequence[str] = ()) -> ParamPolicy | None:
    """The ``ParamPolicy`` ``param_policy`` gives parameter ``name``. A mapping's patterns match any of the
    parameter's names (``names``: all of them, tied aliases included; default ``(name,)``), first match
    wins per name; a callable is called with ``name``. Raises ``PolicyError`` when two aliases of one tied
    parameter get different policies."""
    if param_policy is None or isinstance(param_policy, ParamPolicy):
        return param_policy
    if callable(param_policy) and not isinstance(param_policy, Mapping):
        return param_policy(name, param)
    hits = []  # (alias, pattern, policy): the first pattern matching each alias
    for alias in names or (name,):
        hit = next(((pattern, policy) for pattern, policy in param_policy.items()
                    if fnmatch.fnmatchcase(alias, pattern)), None)
        if hit is not None:
            hits.append((alias, *hit))
    for alias, pattern, policy in hits[1:]:
        if policy != hits[0][2]:
            raise PolicyError(f"parameter '{name}' is tied: param_policy pattern '{hits[0][1]}' matches its "
                              f"name '{hits[0][0]}' and pattern '{pattern}' its name '{alias}', with "
                              "different policies; give one policy to the parameter (one pattern, or equal "
                              "policies)")
    return hits[0][2] if hits else None


def check_patterns(names: list[str], param_policy) -> None:
    """Raise ``PolicyError`` for a pattern of a mapping ``param_policy`` that matches no parameter
    (``names``: every name of every parameter, tied aliases included)."""
    if not isinstance(param_policy, Mapping):
        return
    for pattern in param_policy:
        if not isinstance(pattern, str):
            raise PolicyError(f"param_policy pattern {pattern!r} is a {type(pattern).__name__}; patterns are "
                              f"glob strings on the parameter names (e.g. {names[:3]}), such as '*.weight'")
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise PolicyError(f"param_policy pattern '{pattern}' matches no parameter of this fully_shard "
                              f"call (names are relative to the module given, e.g. {names[:3]}); fix the "
                              "pattern")


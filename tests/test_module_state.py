"""Every module-level mutable object left in ``perparam/``, each with the one reason it may be one.

State belongs to objects with a lifetime (a group, a parameter, an optimizer's binding, a root's context),
not to module tables. This test reads every file of ``perparam/`` (no import) and lists each module-level
assignment of a mutable container (a dict, list or set display or comprehension; ``dict()``, ``list()``,
``set()``, ``defaultdict``, ``OrderedDict``, ``deque``, ``Counter``, ``bytearray``, ``threading.local``, the
weak dictionaries and sets) and each ``global`` statement. A new one fails until it is added to ``ALLOWED``
with its reason (or given an owner); one listed that is gone fails until its row goes. A row whose reason
starts with "constant" is also checked never to be written in its module (no item assignment, no mutating
method, no ``global``). ``__all__`` is not state.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parent.parent / "perparam"

_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "bytearray",
                    "local", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "WeakIdKeyDictionary"})
_DISPLAYS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "add",
                       "discard", "setdefault", "sort", "reverse"})

_ONCE = "a process-wide 'said once' flag: a warning or hook that must not repeat per object"
_WEAK_PG = "weak on a c10d process group (threaded ranks each have theirs); dies with the group"

#: "path:name" (a ``global`` statement: "path:global name") -> why it may be module-level mutable state
ALLOWED = {
    # -- the core: sharding, comm, runtime ----------------------------------------------------------------
    "sharding/quant.py:_REGISTRY": "the quantizer registry by name: process-wide by design (register/get), "
                                   "filled at import and by users",
    "comm/c10d.py:NAMES": "the c10d names chosen once at import for this torch (tests force the older ones)",
    "comm/counter.py:_counters": "the CommCounters recording now (a context manager's stack: entered and "
                                 "left by their owner; process-wide, as backward hooks run on autograd's "
                                 "thread)",
    "comm/debug.py:global _enabled": "configure(debug=...), a process-wide setting read at every collective",
    "comm/debug.py:global _timeout_s": "configure(debug_timeout=...), the same setting's timeout",
    "comm/peers.py:_ROSTER": "the peers' (host, pid) of the one default process group, as they post them",
    "comm/peers.py:_state": "the default group's store client and last checkpoint: one per process, as the "
                            "default group is",
    "comm/point_to_point.py:_threads": "the waiter threads, weakly: joined by the atexit hook (a thread is "
                                       "process state)",
    "comm/point_to_point.py:_waiters": "the waiter thread per (pid, process group): a forked child starts "
                                       "its own",
    "comm/process_groups.py:_REDUCE_GROUPS": _WEAK_PG + ": its reduction group",
    "comm/process_groups.py:_COUNTERS": _WEAK_PG + ": ParamGroups counted per default group",
    "comm/process_groups.py:_WARM": _WEAK_PG + ": communicators warmed up",
    "comm/process_groups.py:_WARM_ORDER": _WEAK_PG + ": the order warmed up, per default group",
    "comm/process_groups.py:_WARNED": _ONCE + " (CUDA_DEVICE_MAX_CONNECTIONS)",
    "comm/sequence.py:_state": "per process group id, its group held weakly: the runs of all-gathers agreed",
    "comm/sequence.py:_entered": _WEAK_PG + ": calls agreed through enter_together",
    "runtime/config.py:global _current": "perparam.configure's settings: process-wide by their definition",
    "runtime/hpz.py:_MESHES": "weak on the mesh: hpZ's secondary process groups, made once per mesh by every "
                              "thread rank alike",
    "runtime/readers.py:READERS": "a table of torch modules that read their children's parameters, completed "
                                  "at import where torch has the module, never written after",
    "runtime/reduction.py:_FLAGS": "a bounded cache (256) of flag tensors keyed by their values, dtype and "
                                   "device: "
                                   "the same content whoever asks",
    "runtime/whole_matrix.py:KNOWN": "constant table: whole-matrix optimizers from outside torch, by class "
                                     "name",
    "runtime/zero.py:_GENERATIONS": "weak on the default process group: the load generation of each thread "
                                    "rank",
    "runtime/zero.py:_NO_WORLD": "the load generation before init_process_group (no group to key it by)",
    # -- the face -----------------------------------------------------------------------------------------
    "api.py:global _WARNED_LOW_PRECISION": _ONCE + " (a parameter stored in bf16/fp16)",
    "module.py:_CLASS_CACHE": "the Sharded<Class> subclass made once per module class (a class is "
                              "process-wide)",
    "clip.py:_SPANS": "weak on the DeviceMesh: the root axes it spans, read once per mesh",
    "cli.py:SUBCOMMANDS": "constant table: the CLI's subcommands",
    "cli.py:HELPS": "constant table: the CLI's help lines",
    "invariant_guard.py:_LIVE": "the InvariantUnits in their mode, weakly: torch's global step hook reads "
                                "them",
    "invariant_guard.py:_STATE": "the handle of torch's global step pre-hook (one per process) and its "
                                 "error type",
    "checkpoint/background.py:_PENDING": "the background saves in flight in this process (its one "
                                         "executor's)",
    "checkpoint/background.py:global _GROUP": "the gloo group of background saves, made once per default "
                                              "group",
    "checkpoint/background.py:global _EXECUTOR": "the background saves' one thread (a thread is process "
                                                 "state)",
    "hf/accelerator.py:_FSDP_CLASSES": "the FSDP-named subclass made once per module class",
    "hf/methods.py:TREE_CHANGES": "constant table: methods that change the module tree",
    # -- beside: memory, offload, elastic -----------------------------------------------------------------
    "memory/formulas.py:_SHARDED": "constant table of the memory formulas",
    "memory/formulas.py:_SUFFIXES": "constant table of the memory formulas",
    "memory/formulas.py:_COLLECTIVES": "constant table of the memory formulas",
    "memory/plan.py:DTYPES": "constant table: dtype names of perparam plan",
    "memory/policy_args.py:DTYPES": "constant table: dtype names of the CLI's policy arguments",
    "memory/presets.py:GPT2_CONFIGS": "constant table: model presets",
    "memory/presets.py:PRESETS": "constant table: model presets",
    "memory/tp_plan.py:_COLWISE": "constant table: tensor-parallel styles by module name",
    "memory/tp_plan.py:_ROWWISE": "constant table: tensor-parallel styles by module name",
    "offload/host.py:_SIDE": "the side stream per device (a stream is device state, shared by every tier)",
    "offload/mapped.py:global _EXECUTORS": "the I/O threads of the disk tier (threads are process state)",
    "offload/mapped.py:global _libc": "libc, loaded once for sync_file_range",
    "offload/scratch.py:_SCRATCH": "one scratch folder per (pid, root): removed at exit",
    "offload/tier.py:_OWNERS": "the ShardedParams with an offloaded tier, weakly: the global step hooks "
                               "read them",
    "offload/tier.py:_hooks": "the handles of torch's global optimizer hooks the tiers install once",
    "offload/tier.py:_STATE_DICT_HOOKED": "optimizers given the state_dict pre-hook, weakly",
    "offload/tier.py:_order": "the offloaded groups in the last forward's order (the prefetch plan)",
    "offload/tier.py:_current": "the offloaded groups of the forward in progress",
    "offload/tier.py:global _order": "the same, replaced at the end of a forward",
    "offload/tier.py:global _current": "the same, started afresh at a forward",
    "offload/tier.py:_groups": "the offloaded groups by key, weakly: each dies with its model",
    "elastic/state.py:_live": "the live elastic States, weakly: the restart handler reads them",
    # -- the main job (a user of perparam, one per process) -----------------------------------------------
    "finetune/checkpointing.py:_in_flight": "the job's checkpoint saves in flight (one job per process)",
    "finetune/cli.py:DEFAULTS": "constant table: the job's defaults",
    "finetune/export.py:EXPORT_DTYPES": "constant table: export formats",
    "finetune/export.py:HF_LAYER_NAMES": "constant table: export names",
    "finetune/export.py:HF_TOP_NAMES": "constant table: export names",
    "finetune/export.py:GGUF_FILE_TYPES": "constant table: export formats",
    "finetune/gguf_loader.py:LAYER_TENSORS": "constant table: GGUF tensor names",
    "finetune/gguf_loader.py:TOP_TENSORS": "constant table: GGUF tensor names",
    "finetune/lifecycle.py:_progress": "the job's progress for its interruption line (one job per process)",
    "finetune/lifecycle.py:_parent": "the job's parent pid once watched (one job per process)",
    "finetune/lifecycle.py:_said": _ONCE + " (why the worker stops)",
    "finetune/lifecycle.py:_stops": "the job's snapshot folder where a stopping worker notes when (one job "
                                    "per "
                                    "process; read in a signal handler, so set before any signal)",
    "finetune/lora.py:TARGETS": "constant table: LoRA's target modules",
    "finetune/peers.py:ROSTER": "the job's ranks as recorded (one job per process)",
    "finetune/tokenizer.py:DIGIT_SPLITTING_PRE": "constant table: a tokenizer's pre-tokenizers",
    "finetune/tokenizer.py:PLAIN_GPT2_PRE": "constant table: a tokenizer's pre-tokenizers",
    "finetune/train.py:PARAM_DTYPES": "constant table: dtype names",
    "finetune/train.py:QUANT_DTYPES": "constant table: dtype names",
}


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _mutable(value) -> bool:
    return isinstance(value, _DISPLAYS) or (isinstance(value, ast.Call) and _name(value.func) in _CALLS)


@functools.cache
def module_state() -> dict[str, ast.Module]:
    """"path:name" of every module-level mutable object and ``global`` statement of ``perparam/`` -> the
    module's tree."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(PACKAGE).as_posix()
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if _mutable(value):
                found.update((f"{rel}:{t.id}", tree) for t in targets
                             if isinstance(t, ast.Name) and t.id != "__all__")
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.update((f"{rel}:global {n}", tree) for n in node.names)
    return found


def _written(tree: ast.Module, name: str) -> bool:
    """``name`` is item-assigned, mutated by a method or declared ``global`` somewhere in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(isinstance(t, ast.Subscript) and _name(t.value) == name for t in targets):
                return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS and _name(node.func.value) == name):
            return True
        if isinstance(node, ast.Global) and name in node.names:
            return True
    return False


def test_every_module_level_mutable_object_is_listed_with_its_reason():
    found = module_state()
    new = sorted(set(found) - set(ALLOWED))
    gone = sorted(set(ALLOWED) - set(found))
    assert not new, (f"module-level mutable state added: {new}. Give it an owner with a lifetime (a group, a "
                     "parameter, an optimizer's Binding, a root's context), freeze a constant table (tuple, "
                     "frozenset, MappingProxyType), or add it to ALLOWED with the reason it is process-wide")
    assert not gone, f"listed in ALLOWED but no longer module-level mutable state (remove the rows): {gone}"


def test_a_constant_table_is_never_written_in_its_module():
    found = module_state()
    written = [key for key, why in ALLOWED.items()
               if why.startswith("constant") and key in found and _written(found[key], key.split(":")[1])]
    assert not written, f"listed as constant tables but written in their module: {written}"

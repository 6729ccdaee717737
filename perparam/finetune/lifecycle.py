"""How ``perparam finetune`` starts and stops: interruptions, a dead launcher, temporary files.

- Ctrl-C (SIGINT) or SIGTERM to the launcher: torch's elastic agent forwards the signal to the workers,
  which exit at once and quietly (a checkpoint being written is left incomplete, and never loaded); the
  launcher prints one line (``interrupted at step 37/200; nothing saved``, or with ``--save``
  ``interrupted at step 37/200; last checkpoint: step 30 in DIR``), removes its temporary folder and exits
  with 130 (SIGINT) or 143 (SIGTERM), as a shell does for a process killed by that signal.
- SIGKILL of the launcher: each worker asked the kernel for a parent-death signal (``PR_SET_PDEATHSIG``,
  Linux) and also watches its parent pid from a thread (other systems, or a parent that died before the
  request); it removes the launcher's temporary folder and exits within about a second.
- A peer that is gone (a node that died, a worker killed) is not an interruption: the worker that finds
  it says so in one line naming the rank or node that is gone and the last checkpoint, and exits 1
  (:mod:`perparam.finetune.peers`); under ``perparam finetune`` the agent stops the other workers at
  once, and the launcher's line names the rank, how it ended and the last checkpoint (``perparam
  finetune: error: rank 1 was killed by signal 9 (its output is above); the other ranks were stopped;
  last checkpoint: step 4 in DIR``). A stopped or hung worker is named and killed by the step watchdog
  (``--step-timeout``, :class:`perparam.elastic.StepWatchdog`), and the run ends as for a dead one. Under
  ``torchrun`` across nodes this holds also when the surviving node's agent, having lost the rendezvous store
  with the node that hosted it, stops its workers with SIGTERM: the worker tells that from a user's signal by
  probing the stores and the roster of ranks.
- A temporary folder left by a launcher that no longer runs (SIGKILL before the workers started, a power
  cut) is named ``perparam-finetune-<pid>-*`` and removed by the next launcher's start.

Workers tell the launcher how far they got through :envvar:`PERPARAM_PROGRESS_FILE` (rank 0 writes
``step total`` after each step, and a second line ``step DIR`` once a checkpoint is complete). Under plain
``torchrun`` there is no such file and rank 0 prints the interruption line itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from perparam.finetune import peers, restart_times
from perparam.finetune.peers import pid_alive

#: env vars the launcher sets for its workers
LAUNCHER_PID_ENV = "PERPARAM_LAUNCHER_PID"
TMPDIR_ENV = "PERPARAM_LAUNCHER_TMPDIR"
PROGRESS_ENV = "PERPARAM_PROGRESS_FILE"
TMP_PREFIX = "perparam-finetune-"
PR_SET_PDEATHSIG = 1

#: rank 0's last finished step, the total and the last complete checkpoint ``(step, folder)`` (for the
#: interruption line under plain torchrun)
_progress = {"step": None, "total": None, "checkpoint": None}
#: the pid of the process that started this worker (our launcher, or torchrun's agent), once watched
_parent = {"pid": None}
#: whether this worker already said (in one line) why it stops
_said = {"done": False}
#: the job's snapshot folder on this node, where a stopping worker notes when (``restart_times.note_stop``)
_stops = {"folder": None}


def exit_code(signum: int) -> int:
    """A shell's exit status for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def saved_text(checkpoint: tuple[int, str] | None) -> str:
    """``"last checkpoint: step 30 in DIR"`` (``checkpoint``: ``(step, folder)`` of the last complete
    ``--save``), or ``"nothing saved"``: the end of every line that says why the job stopped."""
    return ("nothing saved" if checkpoint is None
            else f"last checkpoint: step {checkpoint[0]} in {checkpoint[1]}")


def interrupted_line(step: int | None, total: int | None, checkpoint: tuple[int, str] | None = None) -> str:
    """The launcher's one line; ``checkpoint``: ``(step, folder)`` of the last complete ``--save``."""
    where = "before training started" if step is None else f"at step {step}/{total}"
    return f"perparam finetune: interrupted {where}; {saved_text(checkpoint)}"


# ----------------------------------------------------------------------------------------- launcher side


def clean_stale_tmpdirs(parent: str | None = None) -> list[Path]:
    """Remove ``perparam-finetune-<pid>-*`` folders whose launcher no longer runs; returns them."""
    removed = []
    root = Path(parent or tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for path in root.glob(f"{TMP_PREFIX}*"):
            pid = path.name[len(TMP_PREFIX):].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)) or not path.is_dir():
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_tmpdir() -> str:
    """The launcher's temporary folder, named after its pid so a later start can tell it is stale."""
    return tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-")


def read_progress(path: str) -> tuple[int | None, int | None, tuple[int, str] | None]:
    """``(step, total, checkpoint)`` from the progress file (``None``s where it is missing)."""
    try:
        lines = Path(path).read_text().splitlines()
        step, total = (None if x == "-" else int(x) for x in lines[0].split())
        checkpoint = None
        if len(lines) > 1:
            saved, folder = lines[1].split(" ", 1)
            checkpoint = (int(saved), folder)
        return step, total, checkpoint
    except (OSError, ValueError, IndexError):
        return None, None, None


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher before its workers ran (a BaseException, as
    KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def launcher_signals():
    """SIGINT/SIGTERM raise :class:`Interrupted` (torch's agent installs its own handlers while workers run:
    they raise its ``SignalException``); the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, _raise_interrupted)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------- worker side


def _parent_gone(parent: int) -> bool:
    """Whether ``parent`` has died: we were reparented, or (the parent-death signal can arrive first) it is
    exiting or a zombie."""
    if os.getppid() != parent:
        return True
    try:
        state = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return not pid_alive(parent)
    return state in ("Z", "X", "x")


def say_once(line: str) -> bool:
    """Write ``line`` to stderr unless this worker already said why it stops; whether it was written."""
    if _said["done"]:
        return False
    _said["done"] = True
    os.write(2, (line + "\n").encode())
    return True


def last_checkpoint() -> tuple[int, str] | None:
    """``(step, folder)`` of the last complete ``--save`` checkpoint this worker knows of, or None."""
    return _progress["checkpoint"]


def note_stops_in(folder) -> None:
    """Under ``--max-restarts``: the job's snapshot folder, where this worker notes when it learnt that its
    group stops (:func:`stopping`), for the next start's ``restart_times`` record."""
    _stops["folder"] = folder


def stopping() -> None:
    """This worker knows its group stops (a peer is lost, or the agent says stop): note the time once."""
    if _stops["folder"] is not None:  # (restart_times is imported already: no import in a signal handler)
        folder, _stops["folder"] = _stops["folder"], None
        restart_times.note_stop(folder, os.environ.get("RANK", "?"),
                                int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))


def _stop_worker(signum: int) -> None:
    """Leave now and quietly: remove the launcher's folder if the launcher is gone, then ``os._exit``
    (no finalizers: a process group torn down in the middle of a collective can abort the process).
    Under plain ``torchrun``, a SIGTERM from the agent that lost a peer node is told apart from a user's
    signal (:func:`perparam.finetune.peers.who_is_gone`): one line, exit 1."""
    stopping()
    if _said["done"]:  # this worker already said why it stops (a lost peer): a failure, not an interruption
        os._exit(1)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    parent_gone = _parent["pid"] is not None and _parent_gone(_parent["pid"])
    if not launcher and not parent_gone and "TORCHELASTIC_RUN_ID" in os.environ:

        # (this node's ranks got the same signal from the same agent: only other nodes' count)
        gone = peers.who_is_gone(other_nodes_only=True)
        if gone is not None:
            say_once(peers.lost_peer_line(os.environ.get("RANK", "?"), gone, None, last_checkpoint()))
            os._exit(1)
    if launcher and parent_gone:
        tmp = os.environ.get(TMPDIR_ENV)
        if tmp and Path(tmp).name.startswith(TMP_PREFIX):
            shutil.rmtree(tmp, ignore_errors=True)
    elif not launcher and parent_gone:  # torchrun's agent died: say so once per node
        if os.environ.get("LOCAL_RANK", "0") == "0":
            rank = os.environ.get("RANK")
            say_once(f"perparam finetune: rank {rank} stopped: its torchrun launcher is gone")
    elif not launcher and os.environ.get("RANK") == "0":  # plain torchrun: no launcher to say it
        say_once(interrupted_line(_progress["step"], _progress["total"], _progress["checkpoint"]))
    os._exit(exit_code(signum))


def _on_signal(signum, frame):
    _stop_worker(signum)


def _watch_parent(parent: int) -> None:
    import time

    while True:
        if os.getppid() != parent:
            _stop_worker(signal.SIGTERM)
        time.sleep(0.5)


def install_worker_handlers() -> None:
    """In a worker: SIGINT/SIGTERM end it quietly; the death of the launcher that started it too."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _on_signal)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher:
        parent = int(launcher)
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent: watch it too
        parent = os.getppid()
    else:
        return
    _parent["pid"] = parent
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before the request above
        _stop_worker(signal.SIGTERM)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="perparam-parent").start()


def step_done(step: int, total: int) -> None:
    """Rank 0, after each optimizer step: remember it (and tell the launcher, if there is one)."""
    _progress["step"], _progress["total"] = step, total
    _write_progress()


def checkpoint_done(step: int, folder: str) -> None:
    """Every rank, once the checkpoint of ``step`` in ``folder`` (the ``--save`` DIR) is complete (rank 0
    also tells the launcher)."""
    _progress["checkpoint"] = (step, str(folder))
    _write_progress()


def _write_progress() -> None:
    path = os.environ.get(PROGRESS_ENV)
    if path and os.environ.get("RANK") == "0":
        step, total = (_progress[k] if _progress[k] is not None else "-" for k in ("step", "total"))
        text = f"{step} {total}\n"  # "- -" before the first step (a resumed run's checkpoint is known)
        if _progress["checkpoint"] is not None:
            text += f"{_progress['checkpoint'][0]} {_progress['checkpoint'][1]}\n"
        with contextlib.suppress(OSError):  # write, then rename: a reader never sees a half-written file
            part = f"{path}.part"
            Path(part).write_text(text)
            os.replace(part, path)

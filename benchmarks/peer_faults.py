"""Seconds from a real fault to the survivors' word on it: a peer SIGKILLed (``perparam.PeerLostError``) or
SIGSTOPped (``perparam.elastic.StepWatchdog``) from outside, in each phase of a user's ``fully_shard`` loop.

    python -m benchmarks.peer_faults [--nproc 2] [--bound 3] [--kill forward,backward,step,save,async_save]
                                     [--stop forward,backward,step]

Each case is one run of ``benchmarks/harness/faults.run_fault`` (the user's script
``benchmarks/harness/fault_worker.py`` on ``--nproc`` processes, rank 1 the victim at step 2). Printed per
case: the survivors' exit status, the seconds from the signal to each survivor's first stderr line (the
watchdog's line or the error's traceback) and to its exit, the stderr line count, and the error's last line.
"""

from __future__ import annotations

import argparse
import signal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--bound", type=float, default=3.0, help="the watchdog's bound for the SIGSTOP cases (s)")
    ap.add_argument("--kill", default="forward,backward,step,save,async_save")
    ap.add_argument("--stop", default="forward,backward,step")
    args = ap.parse_args()
    from benchmarks.harness.faults import run_fault

    cases = [("SIGKILL", p, signal.SIGKILL, None) for p in args.kill.split(",") if p]
    cases += [("SIGSTOP", p, signal.SIGSTOP, args.bound) for p in args.stop.split(",") if p]
    for name, phase, sig, bound in cases:
        fault = run_fault(args.nproc, phase, sig, watchdog=bound)
        for rank in range(args.nproc):
            if rank == 1:
                continue
            detected, exited = fault.detected_s[rank], fault.exited_s[rank]
            print(f"{name} of rank 1 in {phase}" + (f" (bound {bound:g} s)" if bound else "") +
                  f": rank {rank} exit {fault.codes[rank]}, first line after "
                  f"{'-' if detected is None else f'{detected:.2f}'} s, exit after "
                  f"{'-' if exited is None else f'{exited:.1f}'} s, {len(fault.err[rank].splitlines())} "
                  f"stderr lines; left stopped: {fault.left_stopped}")
            print(f"    {fault.error_line(rank)[:400]}")


if __name__ == "__main__":
    main()

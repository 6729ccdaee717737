"""Rich tables for ``perparam memory`` and ``perparam plan``. Figures are GB = 10**9 bytes unless labelled."""

from __future__ import annotations

import io
from fractions import Fraction
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

from perparam.memory.formulas import (
    GB,
    BytesPerParam,
    ModelState,
    Number,
    StageCommunication,
    StageMemory,
    format_fixed,
    format_gb,
)

if TYPE_CHECKING:
    from perparam.memory.plan import ModelPlan
    from perparam.memory.stage_budget import StageFit

#: Width used when stdout is not a terminal (pipes, files, tests), so no column is cut.
PIPE_WIDTH = 132


def console() -> Console:
    """A console on stdout; plain text and ``PIPE_WIDTH`` columns when stdout is not a terminal."""
    con = Console(highlight=False)
    if not con.is_terminal:
        con = Console(highlight=False, width=max(con.width, PIPE_WIDTH), no_color=True)
    return con


def _num(x: Number, sep: bool = False) -> str:
    x = Fraction(x)
    if x.denominator == 1:
        return f"{x.numerator:,}" if sep else str(x.numerator)
    return format_fixed(x, 4)


def _table(title: str) -> Table:
    return Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left")


def show(con: Console, table: Table, note: str = "") -> None:
    """Print ``table``, then ``note`` unwrapped (a caption would wrap to the table's width), then a blank
    line.

    Numbers are never cut: right-aligned (number) columns do not wrap, text columns wrap; a table whose
    numbers alone are wider than the terminal is printed at its own width (the terminal wraps the lines).
    """
    words = set()
    for column in table.columns:
        cells = [str(cell) for cell in (column.header, *column.cells)]
        if column.justify == "right":
            column.no_wrap = True
            words.update(c for c in cells if c)
        else:  # wrap at spaces
            column.overflow = "fold"
            words.update(w for c in cells for w in c.split() if len(w) <= 24)
    width = con.width
    while width < 1000:  # the narrowest width, from the terminal's up, at which every number and word shows
        probe = Console(file=io.StringIO(), width=width, no_color=True, highlight=False)
        probe.print(table)
        text = probe.file.getvalue()
        if "…" not in text and all(w in text for w in words):
            break
        width += 2
    saved, con.width = con.width, width  # (print(width=) would clamp to the console's width)
    try:
        con.print(table)
    finally:
        con.width = saved
    if note:
        con.print(note, style="dim", soft_wrap=True)
    con.print()


def components_table(state: ModelState, bpp: BytesPerParam) -> tuple[Table, str]:
    """Table 7-1 shape: params, grads and optimizer state of the unsharded model (bytes/param and GB)."""
    t = _table(f"Model state of {state.num_params:,} parameters (every DDP rank holds all of it)")
    note = ("Bytes per parameter: mixed-precision Adam, ZeRO paper Sec. 3.1 (2 + 2 + 12). GB = 1e9 bytes.")
    t.add_column("component")
    t.add_column("bytes/param", justify="right")
    t.add_column("GB", justify="right")
    t.add_column("what")
    t.add_row("params", _num(bpp.params), format_gb(state.params, 6), "weights used in forward/backward")
    t.add_row("grads", _num(bpp.grads), format_gb(state.grads, 6), "one gradient per weight")
    t.add_row("optimizer", _num(bpp.optimizer), format_gb(state.optimizer, 6),
              "Adam: fp32 master copy + 2 moments")
    t.add_section()
    t.add_row("total per rank", _num(bpp.total), format_gb(state.total, 6), "")
    return t, note


def stages_table(rows: list[StageMemory]) -> tuple[Table, str]:
    """Table 7-2 shape: per-rank model state of each stage and how many times less than DDP."""
    k = rows[0].world_size
    t = _table(f"Per-rank model state over K = {k} data-parallel ranks (GB)")
    note = ("ZeRO-1 = P + G + O/K, ZeRO-2 = P + (G + O)/K, ZeRO-3 = (P + G + O)/K (ZeRO paper, Sec. 5 / "
            "Fig. 1).\nPersistent model state only: no activations, all-gather buffers or fragmentation.")
    t.add_column("stage")
    for col in ("params GB", "grads GB", "optimizer GB", "per rank GB", "x less than DDP"):
        t.add_column(col, justify="right")
    for s in rows:
        t.add_row(s.stage, format_gb(s.params), format_gb(s.grads), format_gb(s.optimizer),
                  format_gb(s.total), format_fixed(s.ratio_vs_ddp, 2))
    return t, note


def communication_table(rows: list[StageCommunication]) -> tuple[Table, str]:
    k = rows[0].world_size
    t = _table(f"Communication per rank per training step as perparam runs each stage, K = {k} (ring "
               "collectives, bytes sent)")
    note = ("DDP: 2(K-1)/K*G; ZeRO-1 (perparam's stage 1 all-reduces G): (K-1)/K*(2G + P); ZeRO-2: "
            "(K-1)/K*(G + P);\nZeRO-3: (K-1)/K*(G + 2P); ZeRO-1 (paper): (K-1)/K*(G + P), the ZeRO paper's "
            "(Sec. 7), not run by perparam.\nWith P = G: 2(K-1)/K*G for DDP, ZeRO-2 and the paper's ZeRO-1, "
            "3(K-1)/K*G for ZeRO-1 and ZeRO-3.")
    t.add_column("stage")
    t.add_column("collectives")
    t.add_column("bytes", justify="right")
    t.add_column("GB", justify="right")
    t.add_column("x DDP", justify="right")
    for c in rows:
        t.add_row(c.stage, c.collectives, _num(c.total, sep=True), format_gb(c.total),
                  format_fixed(c.volume_vs_ddp, 2))
    return t, note


def budget_table(fits: list[StageFit], chosen: StageFit | None, min_world: int | None) -> tuple[Table, str]:
    """``perparam memory --budget``: per stage, Table 7-2's bytes per rank, whether they fit the budget, and
    the bytes sent per step as perparam runs the stage; the note names the stage chosen."""
    budget = fits[0].budget
    t = _table(f"Which stage fits a budget of {format_gb(budget)} GB of model state per rank")
    t.add_column("stage")
    for col in ("per rank GB", "fits", "headroom GB", "sent per step GB", "x DDP"):
        t.add_column(col, justify="right")
    for f in fits:
        t.add_row(f.stage, format_gb(f.bytes_per_rank), "yes" if f.fits else "no",
                  format_gb(f.budget - f.bytes_per_rank), format_gb(f.sent_per_step),
                  format_fixed(f.traffic_vs_ddp, 2))
    note = ("Sent per step as perparam runs each stage (docs/zero-stages.md): DDP 2(K-1)/K*G; stage 1 "
            "all-reduces G and all-gathers P, 2(K-1)/K*G + (K-1)/K*P;\nstage 2 (K-1)/K*(G + P); stage 3 "
            "(K-1)/K*(G + 2P). Stages 1 and 2 also hold the shard the optimizer updates (P/K) unless it is "
            "the fp32 master in O.\n")
    if chosen is not None:
        how = ("placement=Replicate()" if chosen.stage == "DDP"
               else f"ParamPolicy(zero_stage={chosen.stage[-1]})")
        note += (f"Fits with the fewest bytes sent: {chosen.stage} ({how}: "
                 f"{format_gb(chosen.bytes_per_rank)} GB per rank, {format_fixed(chosen.traffic_vs_ddp, 2)}x "
                 "DDP's traffic).")
    else:
        note += ("No stage fits: ZeRO-3 fits this budget from K = "
                 + f"{min_world:,} ranks on, or raise the budget."
                 if min_world is not None else "No stage fits a budget of 0 bytes.")
    return t, note


def print_memory(con: Console, state: ModelState, bpp: BytesPerParam, stages: list[StageMemory],
                 comm: list[StageCommunication]) -> None:
    for table, note in (components_table(state, bpp), stages_table(stages), communication_table(comm)):
        show(con, table, note)


def _pct(x: Number, ref: Number) -> str:
    if not ref:
        return "-"
    diff = (Fraction(x) / Fraction(ref) - 1) * 100
    return ("+" if diff >= 0 else "") + format_fixed(diff, 3) + "%"


def print_plan(con: Console, plan: ModelPlan, description: str, rank: int = 0,
               params_table: bool = False) -> None:
    """Summary, per-rank bytes next to the ZeRO-3 formula, and optionally the per-parameter table."""
    from perparam.memory.plan import placement_str

    dtypes = sorted({str(p.layout.dtype).removeprefix("torch.") for p in plan.params})
    itemsizes = sorted({p.layout.itemsize for p in plan.params})
    grad = (f"{'/'.join(map(str, itemsizes))} (as params)" if plan.grad_bytes is None
            else _num(plan.grad_bytes))
    placements = sorted({placement_str(p.placements) for p in plan.params})
    tp = f" x tp = {plan.tp} (tp rank {plan.tp_rank}; tp rank 0 holds the most)" if plan.tp > 1 else ""
    summary = _table(f"Plan: {plan.model_name} on a shard axis of K = {plan.world_size} ranks{tp} (no "
                     "processes)")
    summary.show_header = False
    summary.add_column("")
    summary.add_column("")
    summary.add_row("model", description)
    summary.add_row("parameters", f"{plan.num_params:,} in {len(plan.params)} tensors (tied counted once); "
                    f"{plan.trainable_params:,} trainable")
    summary.add_row("placements", ", ".join(placements))
    summary.add_row("bytes per element", f"params {'/'.join(map(str, itemsizes))} ({', '.join(dtypes)}), "
                    f"grads {grad}, optimizer {_num(plan.optim_bytes)}")
    summary.add_row("all-gather slot",
                    f"{plan.padded_param_bytes_per_rank:,} bytes per rank, padding included")
    sent, plain = plan.reduce_scatter_bytes_per_rank, plan.reduce_scatter_bytes_unquantized
    ratio = (f" ({format_fixed(Fraction(sent, plain), 3)} x the reduce dtype's: grad_quant)" if sent != plain
             else "")
    summary.add_row("reduce-scatter", f"{sent:,} bytes sent per rank per step, flags included{ratio}")
    show(con, summary)

    formula = plan.formula("ZeRO-3")
    nominal = plan.nominal_formula("ZeRO-3")
    t = _table(f"Per-rank model state of {plan.model_name}, K = {plan.world_size} (GB)")
    note = ("Plan rows: bytes of each rank's shards, no padding (summed over ranks = unsharded, exactly). "
            "torch.chunk layout: the first ranks hold ceil(S/K) rows, so rank 0 holds the most.\n"
            "Formula rows: ZeRO-3 (P + G + O)/K (ZeRO paper, Sec. 5 / Fig. 1) at the plan's bytes per "
            "parameter.")
    t.add_column("")
    for col in ("params GB", "grads GB", "optimizer GB", "total GB", "total bytes", "vs formula"):
        t.add_column(col, justify="right")

    def row(label: str, p: Number, g: Number, o: Number, ref: Number | None = None) -> None:
        total = Fraction(p) + Fraction(g) + Fraction(o)
        t.add_row(label, format_gb(p), format_gb(g), format_gb(o), format_gb(total), _num(total, sep=True),
                  "" if ref is None else _pct(total, ref))

    mx, mn = plan.max_rank, plan.min_rank
    shown = plan.rank(rank)
    row(f"plan: rank {rank}", shown.params, shown.grads, shown.optimizer, formula.total)
    row(f"plan: max over ranks (rank {mx.rank})", mx.params, mx.grads, mx.optimizer, formula.total)
    row(f"plan: min over ranks (rank {mn.rank})", mn.params, mn.grads, mn.optimizer, formula.total)
    s = plan.sum_over_ranks()
    k = plan.world_size
    row("plan: mean over ranks", Fraction(s.params, k), Fraction(s.grads) / k, Fraction(s.optimizer) / k,
        formula.total)
    t.add_section()
    row(f"ZeRO-3 formula, N = {plan.num_params:,}", formula.params, formula.grads, formula.optimizer)
    if nominal is not None:
        n = plan.nominal_params
        row(f"ZeRO-3 formula, nominal N = {n:,}", nominal.params, nominal.grads, nominal.optimizer)
    t.add_section()
    u = plan.unsharded
    row("unsharded (DDP, every rank)", u.params, u.grads, u.optimizer)
    if nominal is not None:
        note += (f"\nmax over ranks vs nominal ZeRO-3 {format_gb(nominal.total)} GB: "
                 f"{_pct(mx.total, nominal.total)} (the model has {plan.num_params:,} parameters, "
                 f"not {plan.nominal_params:,})")
    show(con, t, note)

    if params_table:
        pt = _table(f"Parameters of {plan.model_name}, local shards on rank {rank} of {plan.world_size}")
        pt.add_column("name", overflow="fold")
        for col, just in (("global shape", "right"), ("placement", "left"),
                          (f"local shape (rank {rank})", "right"), ("dtype", "left"),
                          ("local bytes", "right")):
            pt.add_column(col, justify=just)
        for p in plan.params:
            pt.add_row(p.name, str(tuple(p.layout.global_shape)), placement_str(p.placements),
                       str(tuple(p.layout.local_shape(rank))), str(p.layout.dtype).removeprefix("torch."),
                       f"{p.layout.local_bytes(rank):,}")
        show(con, pt)


__all__ = ["GB", "console", "components_table", "stages_table", "communication_table", "budget_table",
           "print_memory", "print_plan"]

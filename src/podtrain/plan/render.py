"""Plain-text rendering of a plan and of a report (fixed-width tables, no colour)."""

from __future__ import annotations

from typing import Any, Sequence

GIB = 2**30


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns right-aligned except the first."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in [header, *rows])


def duration(seconds: float) -> str:
    """Seconds as the largest sensible unit."""
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def money(usd: float | None) -> str:
    """USD, or n/a."""
    return "n/a" if usd is None else f"${usd:,.0f}" if usd >= 100 else f"${usd:,.2f}"


def render_plan(plan: Any) -> str:
    """The text of ``podtrain plan``."""
    m, s, t = plan.machine, plan.shape, plan.time
    out = [
        f"model: {plan.preset}, {s.params / 1e6:,.1f}M parameters with {plan.vocab_source} "
        f"({s.vocab:,}), {s.flops_per_token / 1e9:.3g} GFLOPs/token | "
        f"{plan.nodes} x {m.name} = {plan.world} device(s), {m.device_memory_bytes / GIB:.1f} GiB each, "
        f"{plan.precision}",
        *([f"vocabulary: {plan.vocab_reason}"] if plan.vocab_reason else []),
        *([f"data: {plan.data_note}"] if plan.data_note else []),
        f"batch: global {plan.tokens_per_step // plan.seq_len:,} sequences = micro-batch {plan.micro_batch} x "
        f"{plan.accum} accumulation step(s) x {plan.world} rank(s); {plan.tokens_per_step:,} tokens per step",
        f"compute: peak {m.peak_flops / 1e12:.3g} TFLOP/s x efficiency {m.efficiency:.2f} "
        f"({m.compute_source}) | busbw: {m.busbw_source}",
        f"step time path: {_path_line(t)}",
        *t.notes,
        "",
        "memory per device (GiB) at the config's micro-batch; 'ac' = activation checkpointing:",
    ]
    items = ("weights", "gradients", "optimizer", "activations", "buffers", "reserve")
    rows = []
    for f in plan.fits:
        for label, mem, largest in ((f.strategy, f.memory, f.max_micro_batch),
                                    (f"{f.strategy}+ac", f.memory_ac, f.max_micro_batch_ac)):
            rows.append([label, *(f"{getattr(mem, k) / GIB:.2f}" for k in items),
                         f"{mem.total / GIB:.2f}", str(largest)])
    out.append(table(["strategy", *items, "total", "max micro"], rows))
    ac = " with activation checkpointing" if plan.checkpointing else ""
    out += [
        "",
        *([f"note: {plan.note}"] if plan.note else []),
        f"plan: {plan.strategy}{ac}; per step ({plan.tokens_per_step:,} tokens):",
        *([_accumulation_line(plan)] if plan.strategy != "ddp" else []),
        table(["component", "time"], [
            ["compute", duration(t.compute_s)], ["optimizer", duration(t.optimizer_s)],
            ["gradient sync (exposed)", f"{duration(t.sync_wait_s)} of {duration(t.comm_s)}"],
            ["data wait", duration(t.data_wait_s)], ["step", duration(t.step_s)],
            ["saves (amortised)", duration(t.save_s)], ["evaluation (amortised)", duration(t.eval_s)],
        ]),
        f"throughput {plan.tokens_per_s:,.0f} tokens/s ({plan.tokens_per_s / plan.world:,.0f} per device) | "
        f"{plan.tokens:,.0f} tokens in {duration(plan.seconds_to_tokens)} | cost {money(plan.cost_usd)}"
        + _price_note(m),
        f"tokens: {plan.tokens_source}",
        *([plan.init_load.line()] if plan.init_load else []),
        "",
        "scaling (same micro-batch per device; '*' = communication exceeds compute):",
    ]
    rows = [[str(r["nodes"]), duration(r["step_s"]), duration(r["compute_s"]), duration(r["comm_s"]),
             f"{r['tokens_per_s']:,.0f}", duration(r["hours"] * 3600), money(r["cost_usd"]),
             "*" if r["comm_exceeds_compute"] else ""] for r in plan.scaling]
    out.append(table(["nodes", "step", "compute", "comm", "tokens/s", "time", "cost", ""], rows))
    first = next((r["nodes"] for r in plan.scaling if r["comm_exceeds_compute"]), None)
    out.append(f"communication exceeds compute from {first} node(s) on" if first
               else "communication stays below compute up to 1024 nodes")
    return "\n".join(out)


def _path_line(t: Any) -> str:
    """Which way the compute was planned: timed here, or FLOPs over a rate."""
    split = (f"decoder matmuls {duration(t.matmul_s)}, attention {duration(t.attention_s)}, "
             f"embedding/LM head/loss {duration(t.other_s)} per step")
    if t.compute_path == "measured":
        return f"measured (a decoder layer, the LM head and loss, and the optimizer timed on this host): {split}"
    return f"FLOP-based (FLOPs / peak x efficiency): {split}"


def _accumulation_line(plan: Any) -> str:
    """fsdp/hsdp: the accumulation mode the run will log at start, and why."""
    need = f"{plan.unsharded_bytes / GIB:.1f} GiB of {plan.machine.device_memory_bytes / GIB:.1f} GiB"
    why = (f"keeping the weights gathered fits ({need})" if plan.accumulate_unsharded
           else f"keeping the weights gathered would need {need}")
    return f"gradient accumulation {plan.accumulation}: {why}"


def _price_note(machine: Any) -> str:
    """Where the cost's price comes from: the user's ``--price-per-hour``, or the dated on-demand
    table (then how to give one's own: a negotiated, spot or reserved price, or a newer one)."""
    from podtrain.launch.instances import ON_DEMAND_USD_PER_HOUR, PRICES_DATE, PRICES_SOURCE

    if machine.price_per_node_hour is None:
        return " (no price: --price-per-hour USD)"
    if machine.name == "local":
        return ""
    if ON_DEMAND_USD_PER_HOUR.get(machine.name.removeprefix("ml.")) != machine.price_per_node_hour:
        return f" (${machine.price_per_node_hour:g}/node-h, from --price-per-hour)"
    return (f" (${machine.price_per_node_hour:g}/node-h on demand as of {PRICES_DATE}, {PRICES_SOURCE}; "
            "--price-per-hour USD for yours)")

"""``podtrain plot RUN_DIR... [--out FILE.png|FILE.html]``: a run's curves in one picture.

Panels against tokens seen: training and validation loss, learning rate, gradient norm,
tokens/s, MFU, data wait, validation bits per byte, the lm-eval tasks' accuracies (``eval.tasks``)
and the tokens trained per data source (``data.mix``: the sources' validation losses join the
loss panel, one line style each), each drawn only when some run has values for it (three panels
a row); several run directories are overlaid, one colour each, and every
restart (a resumed attempt) is a dotted vertical line. The records come de-duplicated from
``observe/records.py``. ``.html`` writes one self-contained file: the PNG embedded plus a table of
each run's final numbers. Needs matplotlib (``pip install 'podtrain[plot]'``).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
from pathlib import Path
from typing import Any

from podtrain.errors import UserError
from podtrain.fsutil import writable_dir
from podtrain.observe.records import RunRecords, read_records

# (panel title, record field, scale to the shown unit, y label)
PANELS: tuple[tuple[str, str, float, str], ...] = (
    ("loss", "loss", 1.0, "nats/token"),
    ("learning rate", "lr", 1.0, "lr"),
    ("gradient norm", "grad_norm", 1.0, "norm before clipping"),
    ("throughput", "tokens_per_s", 1.0, "tokens/s"),
    ("MFU", "mfu", 100.0, "% of peak"),
    ("data wait", "data_wait_s", 1000.0, "ms per step"),
)
SOURCE_STYLES = (":", "-.", (0, (5, 1)), (0, (1, 3)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain plot``."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to overlay")
    parser.add_argument("--out", default=None,
                        help="output file, .png or .html (default: plot.png in the first RUN_DIR)")


def run(args: argparse.Namespace) -> int:
    """Read every run, draw, write; prints the output path."""
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "plot.png"
    if out.suffix.lower() not in (".png", ".html"):
        raise UserError(f"--out {out}: the file name must end in .png or .html")
    runs = [read_records(d) for d in args.run_dirs]
    for r in runs:
        if not r.train:
            raise UserError(f"{r.run_dir / 'metrics.jsonl'} holds no training records yet")
    writable_dir(out.parent)  # before drawing: a read-only disk is one line at once
    png = render_png(runs)
    if out.suffix.lower() == ".png":
        out.write_bytes(png)
    else:
        out.write_text(render_html(runs, png), encoding="utf-8")
    print(f"wrote {out}")
    return 0


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("podtrain plot needs matplotlib (pip install 'podtrain[plot]')") from None
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict[str, Any]], key: str, scale: float) -> tuple[list[float], list[float]]:
    points = [(r["tokens_seen"], scale * r[key]) for r in records
              if r.get(key) is not None and r.get("tokens_seen") is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _source_series(records: list[dict[str, Any]], field: str) -> dict[str, tuple[list[float], list[float]]]:
    """``{source: (tokens seen, value)}`` of a per-source field (``tokens_by_source``)."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for r in records:
        for source, value in (r.get(field) or {}).items():
            if value is not None and r.get("tokens_seen") is not None:
                xs, ys = out.setdefault(source, ([], []))
                xs.append(r["tokens_seen"])
                ys.append(value)
    return out


def _source_panels(loss_ax, tokens_ax, records: RunRecords, colour: str, name: str) -> None:
    """Per data source: validation loss in the loss panel, tokens trained in their own panel
    (``tokens_ax``: None when no run mixes sources)."""
    for j, (source, (xs, ys)) in enumerate(_source_series(records.eval, "val_loss_by_source").items()):
        loss_ax.plot(xs, ys, color=colour, ls=SOURCE_STYLES[j % len(SOURCE_STYLES)], marker=".",
                     label=f"{name} validation {source}")
    if tokens_ax is None:
        return
    for j, (source, (xs, ys)) in enumerate(_source_series(records.train, "tokens_by_source").items()):
        styles = ("-",) + SOURCE_STYLES
        tokens_ax.plot(xs, ys, color=colour, ls=styles[j % len(styles)], label=f"{name} {source}")


BPB, TASKS, SOURCES = "validation bits per byte", "eval tasks", "tokens by source"
UNITS = {BPB: "bits/byte", TASKS: "accuracy", SOURCES: "tokens trained"}


def panel_titles(runs: list[RunRecords]) -> list[str]:
    """The panels worth drawing, in order: each of ``PANELS`` and the evaluation's and mixture's
    panels only where some run has a value for it (a run without ``eval.tasks`` gets no empty
    "eval tasks" panel, a single-source run no "tokens by source")."""
    def has(records: list[dict[str, Any]], key: str) -> bool:
        return any(r.get(key) is not None for r in records)

    titles = [title for title, key, _, _ in PANELS if any(has(r.train, key) for r in runs)]
    if any(has(r.eval, "val_bpb") for r in runs):
        titles.append(BPB)
    if any(task_metrics(r.eval) for r in runs):
        titles.append(TASKS)
    if any(len(_source_series(r.train, "tokens_by_source")) > 1 for r in runs):
        titles.append(SOURCES)
    return titles


COLUMNS = 3


def render_png(runs: list[RunRecords]) -> bytes:
    """The panels with data (``panel_titles``) as PNG bytes, three a row (one colour per run,
    restarts dotted)."""
    plt = _pyplot()
    fig = draw_figure(runs)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def draw_figure(runs: list[RunRecords]):
    """The matplotlib figure ``render_png`` saves (the caller closes it)."""
    plt = _pyplot()
    titles = panel_titles(runs)
    rows = -(-len(titles) // COLUMNS)
    fig, grid = plt.subplots(rows, COLUMNS, figsize=(16, 12.5 * rows / 3), constrained_layout=True,
                             squeeze=False)
    axes = dict(zip(titles, grid.flat))
    for ax in list(grid.flat)[len(titles):]:
        ax.remove()  # the last row's unused places
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, records in enumerate(runs):
        colour, name = colours[i % len(colours)], _label(records, runs)
        for title, key, scale, unit in PANELS:
            if title not in axes:
                continue
            ax = axes[title]
            xs, ys = _series(records.train, key, scale)
            ax.plot(xs, ys, color=colour, lw=1.4, label=f"{name} train" if key == "loss" else name)
            if key == "loss":
                vx, vy = _series(records.eval, "val_loss", 1.0)
                ax.plot(vx, vy, color=colour, ls="--", marker="o", ms=4, label=f"{name} validation")
            for restart in records.restarts:
                ax.axvline(restart["tokens_seen"], color=colour, ls=":", lw=1.2)
            ax.set_ylabel(unit)
        _eval_panels(axes.get(BPB), axes.get(TASKS), records, colour, name)
        _source_panels(axes["loss"], axes.get(SOURCES), records, colour, name)
    from matplotlib.ticker import EngFormatter, MaxNLocator

    for title, ax in axes.items():
        ax.set_title(title)
        ax.set_xlabel("tokens seen")
        # Token counts run to 10^9-10^12: full digits on six ticks overlapped in a panel a third of
        # the page wide. At most five ticks, written 250M, 1.5G.
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        if title in UNITS:
            ax.set_ylabel(UNITS[title])
        ax.grid(True, alpha=0.3)
        if title in ("loss", TASKS, SOURCES):
            ax.legend(fontsize=8)
    if any(r.restarts for r in runs):
        restart_ax = axes.get("learning rate", grid.flat[0])
        restart_ax.plot([], [], color="grey", ls=":", label="restart (resumed)")
        restart_ax.legend(fontsize=8)
    fig.suptitle("podtrain: " + ", ".join(_label(r, runs) for r in runs))
    return fig


def task_metrics(records: list[dict[str, Any]]) -> list[str]:
    """The lm-eval accuracy fields of evaluation records (``podtrain-next-line/acc``...), sorted."""
    return sorted({k for r in records for k in r if "/" in k and k.rsplit("/", 1)[-1] in ("acc", "acc_norm")})


def _eval_panels(bpb_ax, tasks_ax, records: RunRecords, colour: str, name: str) -> None:
    """Validation bits per byte, and one line per task metric (a marker style each); an axis is
    None where no run has that panel."""
    if bpb_ax is not None:
        xs, ys = _series(records.eval, "val_bpb", 1.0)
        bpb_ax.plot(xs, ys, color=colour, marker="o", ms=4, label=name)
    if tasks_ax is not None:
        for (key, style) in zip(task_metrics(records.eval), ("-", "--", ":", "-.") * 8):
            tx, ty = _series(records.eval, key, 1.0)
            tasks_ax.plot(tx, ty, color=colour, ls=style, marker="s", ms=4, label=f"{name} {key}")


def _label(records: RunRecords, runs: list[RunRecords]) -> str:
    """The run directory's name, or its path where two runs share a name."""
    names = [r.run_dir.name for r in runs]
    return records.run_dir.name if names.count(records.run_dir.name) == 1 else str(records.run_dir)


def summary_rows(runs: list[RunRecords]) -> list[dict[str, str]]:
    """Each run's final numbers, as text: step, tokens, losses, mean throughput and MFU, restarts."""
    rows = []
    for r in runs:
        last = r.train[-1]
        mfus = [t["mfu"] for t in r.train if t.get("mfu") is not None]
        vals = [e for e in r.eval if "val_loss" in e]
        rows.append({
            "run": _label(r, runs), "step": str(last["step"]), "tokens": f"{last.get('tokens_seen', 0):,}",
            "train loss": f"{last['loss']:.4f}",
            "validation loss": f"{vals[-1]['val_loss']:.4f}" if vals else "n/a",
            "bits/byte": f"{vals[-1]['val_bpb']:.4f}" if vals and "val_bpb" in vals[-1] else "n/a",
            **{key: f"{[e for e in r.eval if key in e][-1][key]:.4f}" for key in task_metrics(r.eval)},
            "tokens/s (mean)": f"{sum(t['tokens_per_s'] for t in r.train) / len(r.train):,.0f}",
            "MFU (mean)": f"{100 * sum(mfus) / len(mfus):.1f}%" if mfus else "n/a",
            "restarts": str(len(r.restarts)),
        })
    return rows


def render_html(runs: list[RunRecords], png: bytes) -> str:
    """One self-contained page: the PNG inline (base64) and the summary table."""
    rows = summary_rows(runs)
    keys = list(dict.fromkeys(k for row in rows for k in row))  # runs may have different tasks
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(row.get(k, 'n/a'))}</td>" for k in keys) + "</tr>"
                   for row in rows)
    image = base64.b64encode(png).decode("ascii")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>podtrain plot</title>"
            "<style>body{font-family:sans-serif}td,th{padding:4px 10px;text-align:right}"
            "table{border-collapse:collapse}tr:nth-child(even){background:#f2f2f2}</style></head>"
            f"<body><table><tr>{head}</tr>{body}</table>"
            f"<img alt='curves' src='data:image/png;base64,{image}'></body></html>\n")

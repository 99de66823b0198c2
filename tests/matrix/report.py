"""Turn matrix results into a Markdown table and loss-curve plots.

``python tests/matrix/report.py RESULTS_DIR OUT_DIR`` reads every
``<upstream>.json`` of RESULTS_DIR, prints the table (layout x upstream: pass /
FAIL / unsupported + reason, wall time), writes OUT_DIR/matrix.md and one PNG
of loss curves per upstream, and exits non-zero if any cell failed.
"""

import json
import sys
from pathlib import Path

from layouts import LAYOUTS, RESUMES

from torchtitan_npu.reporting.table import format_markdown_table
from torchtitan_npu.tools.loss_compare import plot_runs


def cell_text(cell: dict | None, notes: list[str]) -> str:
    """A table cell; long reasons become numbered notes under the table."""

    def note(reason: str) -> str:
        if reason not in notes:
            notes.append(reason)
        return f"[{notes.index(reason) + 1}]"

    if cell is None:
        return "not run"
    if cell["status"] == "unsupported":
        return f"unsupported {note(cell['reason'])}"
    if "wall_s" not in cell:  # crashed before any check finished
        return f"**FAIL** {note(cell['reason'])} (see pytest output)"
    parity = f"{max(cell['parity_max_rel_loss'], cell['parity_max_rel_grad_norm']):.1e}"
    timing = f"{cell['wall_s']:.0f}s, parity {parity}"
    if "logits_max_abs_diff" in cell:  # the upgrade cell
        timing += f", logits {cell['logits_max_abs_diff']:.1e}"
    if cell["status"] == "upstream issue":
        return f"upstream bug {note(cell['reason'])} ({timing})"
    if cell["status"] == "fail":
        return f"**FAIL** {cell['reason']} ({timing})"
    crashes = "".join(f", retried {note(c)}" for c in cell.get("crashes", []))
    return f"pass ({timing}{crashes})"


def upgrade_text(cell: dict) -> str:
    """The upgrade cell's two loss curves, side by side."""
    old, new = cell["loss_before"], cell.get("loss", {})
    rows = [
        [step, f"{old[step]:.5f}", f"{new[step]:.5f}" if step in new else ""]
        for step in sorted(old, key=int)
    ]
    headers = [
        "step",
        f"torchtitan {cell['upgrade_from']}",
        f"{cell['upstream']} resumed",
    ]
    return (
        f"\n## Upgrade {cell['upgrade_from']} -> {cell['upstream']}\n\n"
        f"Data position: {cell['data']}.\n\n"
        f"{format_markdown_table(headers, rows)}\n"
    )


def main(results_dir: str, out_dir: str) -> int:
    files = sorted(Path(results_dir).glob("*.json"))
    if not files:
        print(f"no matrix results in {results_dir}")
        return 1
    cells = [c for f in files for c in json.loads(f.read_text())]
    upstreams = sorted({c["upstream"] for c in cells}, reverse=True)
    by_key = {(c["upstream"], c["layout"]): c for c in cells}
    every = [lay.name for lay in LAYOUTS] + [r.name for r in RESUMES] + ["upgrade"]
    layouts = [name for name in every if any(c["layout"] == name for c in cells)]
    notes: list[str] = []
    rows = [
        [f"{name} ({next(c['nproc'] for c in cells if c['layout'] == name)}p)"]
        + [cell_text(by_key.get((u, name)), notes) for u in upstreams]
        for name in layouts
    ]
    table = format_markdown_table(
        ["layout"] + [f"torchtitan {u}" for u in upstreams], rows
    )
    total = sum(c.get("wall_s", 0) for c in cells)
    text = (
        "# titan-npu matrix\n\n"
        "Each cell: parity with the single-device run (max relative difference of "
        "loss / grad_norm), bit-identical determinism over two launches, and "
        "bit-identical resume from a mid-run checkpoint.\n\n"
        f"{table}\n\n"
        + "".join(f"[{i}] {text}\n" for i, text in enumerate(notes, 1))
        + f"\nCell wall time in total: {total / 60:.1f} min\n"
        + "".join(upgrade_text(c) for c in cells if c.get("loss_before"))
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text(text)
    print(text)
    for upstream in upstreams:
        # A later partial rerun replaces the work folder of earlier cells.
        runs = {
            c["layout"]: c["dump"]
            for c in cells
            if c["upstream"] == upstream and c.get("dump") and Path(c["dump"]).is_dir()
        }
        if runs:
            path = plot_runs(
                runs, out / f"loss-{upstream}.png", title=f"torchtitan {upstream}"
            )
            print(f"plot: {path}")
    failed = [c for c in cells if c["status"] == "fail"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""The last profiled step as a Gantt chart (PNG): per device, the measured timeline above the
simulated one.  Each row has four bands: kernels and data reads (colored by phase), transfers in,
transfers out, and waiting (colored by what it waits for)."""

from __future__ import annotations

from taskrt.observing.timeline import DATA, KERNELS, TRANSFERS_IN, TRANSFERS_OUT, WAITING, WAITS

PHASE_COLORS = {"fwd": "#4c72b0", "bwd": "#dd8452", "loss": "#8172b3", "recompute": "#64b5cd", "sync": "#55a868",
                "data": "#da8bc3", "other": "#937860"}
RECOMPUTE_PHASES = ("recompute", "reslice", "resend")  # forward values computed again (taskrt.planning.recompute)
SYNC_PHASES = ("update", "reduce", "grad", "wfetch", "wgather", "fstats", "bstats", "running")
WAIT_COLORS = dict(zip(WAITS, ("#c8c8c8", "#f2c14e", "#8c8c8c", "#e4e4e4", "#b0b0b0")))
TRANSFER_COLORS = {TRANSFERS_IN: "#c44e52", TRANSFERS_OUT: "#e8a0a2"}
BANDS = {KERNELS: (0.45, 0.5), DATA: (0.45, 0.5), TRANSFERS_IN: (0.31, 0.12), TRANSFERS_OUT: (0.17, 0.12),
         WAITING: (0.03, 0.12)}  # lane -> (offset in the row, height)


def phase_color(span) -> str:
    if span.lane == DATA:
        return PHASE_COLORS["data"]
    phase = span.name.split(" ")[0].rsplit("-", 1)[-1]
    if phase in ("fwd", "bwd", "loss"):
        return PHASE_COLORS[phase]
    if phase in RECOMPUTE_PHASES:
        return PHASE_COLORS["recompute"]
    return PHASE_COLORS["sync" if phase in SYNC_PHASES else "other"]


def span_color(span) -> str:
    if span.lane in (KERNELS, DATA):
        return phase_color(span)
    if span.lane == WAITING:
        return WAIT_COLORS[span.name]
    return TRANSFER_COLORS[span.lane]


def write_gantt(profile, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    step = profile.last
    simulated = profile.simulated_at(step)
    timelines = [t for t in (step, simulated) if t is not None]
    rows = [(device, t) for device in step.devices for t in timelines]
    height = 2.3 + 0.75 * len(rows)  # inches: the rows, the title above, the axis and legend below
    fig, ax = plt.subplots(figsize=(14, height))
    fig.subplots_adjust(left=0.1, right=0.98, top=1 - 0.5 / height, bottom=1.3 / height)
    labels = []
    for i, (device, timeline) in enumerate(rows):
        y = len(rows) - 1 - i
        labels.append((y + 0.5, f"device {device} {timeline.source}"))
        by_color: dict[tuple, list] = {}
        for span in timeline.on(device, *BANDS):
            offset, height = BANDS[span.lane]
            by_color.setdefault((span_color(span), offset, height), []).append(
                ((span.start_s - timeline.start_s) * 1e3, span.seconds * 1e3))
        for (color, offset, height), bars in by_color.items():
            ax.broken_barh(bars, (y + offset, height), facecolors=color, edgecolors="none")
        ax.axhline(y, color="#f0f0f0" if i % len(timelines) else "#707070", linewidth=0.8)
        ax.plot([timeline.wall_s * 1e3] * 2, [y, y + 1], color="black", linewidth=1.0)
    ax.set_yticks([y for y, _ in labels], [label for _, label in labels])
    ax.set_ylim(0, len(rows))
    ax.set_xlim(0, max(t.wall_s for t in timelines) * 1e3 * 1.02)
    ax.set_xlabel("ms from the step's start (black line: the step's end)")
    title = f"{profile.graph} under {profile.strategy or 'its strategy'}, step {step.step}: measured " \
            f"{step.wall_s * 1e3:.1f} ms"
    if simulated is not None:
        title += f", simulated {simulated.wall_s * 1e3:.1f} ms"
    ax.set_title(title + f" ({profile.machine})")
    legend = [Patch(color=c, label=f"kernels: {p}" if p not in ("data",) else "data read") for p, c in
              PHASE_COLORS.items()]
    legend += [Patch(color=c, label=lane) for lane, c in TRANSFER_COLORS.items()]
    legend += [Patch(color=c, label=name) for name, c in WAIT_COLORS.items()]
    fig.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 0.02), ncol=5, fontsize=8, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)

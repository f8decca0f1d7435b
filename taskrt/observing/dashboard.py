"""The taskrt page of the Dask dashboard: the strategy a Trainer runs, at /taskrt.

    layers x devices grid: each layer's split (n, c, h, w degrees) and the devices of its parts
    bytes per device pair per step: planned (the plan) and measured (the workers' transfer logs)
    step times: measured per step against the predicted step time
    the last profiled step (Trainer.profile): per device, measured above simulated

The page is a Bokeh application served by the scheduler's own dashboard.  It registers itself
when this module is imported before the scheduler starts: Machine.local does so, and a separate
scheduler takes it as a preload (`dask scheduler --preload taskrt.dashboard`).  Trainers publish
what the page shows as scheduler metadata under the key "taskrt" (see `publish`), so the page
works wherever the scheduler runs.
"""

from __future__ import annotations

import logging
import time

PATH = "/taskrt"  # one level, like the dashboard's own pages: Bokeh's static files resolve relative to it
METADATA_KEY = "taskrt"
PROFILE_KEY = "taskrt-profile"  # the last profiled step: published once, not with every step
PUBLISH_EVERY_S = 1.0  # at most one publication per second: a scheduler round trip each
MEASURE_EVERY_S = 10.0  # reading the transfer logs asks every worker
MAX_STEPS_SHOWN = 500
MAX_SPANS_SHOWN = 20_000  # of a profiled step, in both timelines


def page_url(client) -> str:
    """The page's address on the dashboard of `client`'s scheduler."""
    link = client.dashboard_link
    return link.rsplit("/", 1)[0] + PATH


def page_data(trainer, measured: dict | None, step_times: list, predicted_s: float | None) -> dict:
    """What the page shows, as plain JSON-ready data.  Devices are named by their number on the
    whole machine, also after a recovery re-planned on some of them."""
    graph, strategy, machine = trainer.graph, trainer.strategy, trainer.machine
    whole = trainer.devices_in_use  # device i of the machine in use is device whole[i] of the whole machine

    def pairs(counts):
        return {f"{whole[s]}->{whole[d]}": int(b) for (s, d), b in sorted(counts.items())}

    layers = []
    for layer in graph:
        cfg = strategy[layer.name]
        layers.append({"name": layer.name, "kind": layer.kind, "degrees": cfg.degrees, "sync": cfg.sync,
                       "devices": list(cfg.devices)})
    return {
        "graph": graph.name, "strategy": strategy.name, "updated": time.time(),
        "devices": [f"{whole[d.id]} ({d.kind})" for d in machine.devices], "machine": machine.description,
        "layers": layers, "steps_done": trainer.steps_done,
        "planned_bytes": pairs(trainer.plan.bytes_by_pair()),
        "measured_bytes": None if measured is None else pairs(measured),
        "measured_step": None if trainer.stats is None else trainer.stats.step,
        "step_times": [[int(step), float(s)] for step, s in step_times[-MAX_STEPS_SHOWN:]],
        "predicted_step_s": predicted_s,
        "recoveries": [{k: r[k] for k in ("at_step", "lost_devices", "devices", "snapshot_step")} | {
            "replayed": len(r["replayed"])} for r in trainer.recoveries],
        "memory": _memory(trainer, whole),
    }


def _memory(trainer, whole) -> list:
    """Per device in use: [device, predicted peak, measured peak (the last step's), its memory]
    in bytes (None where not known)."""
    try:
        uses = trainer.memory()
    except Exception as error:  # noqa: BLE001  (the page is a view: it shows what it can)
        logging.getLogger("taskrt").debug("no memory on the dashboard page: %r", error)
        return []
    return [[whole[d], u.predicted.total, u.observed, u.capacity]
            for d, u in sorted(uses.items())]


class Publisher:
    """Sends a trainer's page data to the scheduler, at most once per PUBLISH_EVERY_S."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.step_times: list = []
        self.predicted_s = trainer.strategy.meta.get("predicted_step_s")
        self._last = 0.0
        self._measured, self._measured_at = None, 0.0
        self._measured_on = None  # the devices in use when measured: a recovery numbers them anew

    def profiled(self, profile):
        """Show the last step of `profile` (a taskrt.observing.profile.Profile) from now on."""
        try:
            self.trainer.machine.client.set_metadata([PROFILE_KEY], {**profile_data(profile), "updated": time.time()})
        except Exception as error:  # noqa: BLE001  (the page is a view, as in `publish`)
            logging.getLogger("taskrt").warning("dashboard page not updated: %r", error)
        self.publish(measure=False)

    def step_finished(self, step: int, wall_s: float, force: bool = False):
        self.step_times.append((step, wall_s))
        now = time.monotonic()
        if force or now - self._last >= PUBLISH_EVERY_S:
            self.publish(measure=force or now - self._measured_at >= MEASURE_EVERY_S)

    def publish(self, measure: bool = True):
        trainer = self.trainer
        self._last = time.monotonic()
        try:
            if measure and trainer.stats is not None:
                self._measured, self._measured_at = trainer.stats.measured_bytes, time.monotonic()
                self._measured_on = list(trainer.devices_in_use)
            if self._measured_on != list(trainer.devices_in_use):  # measured before a recovery
                self._measured = None
            data = page_data(trainer, self._measured, self.step_times, self.predicted_s)
            trainer.machine.client.set_metadata([METADATA_KEY], data)
        except Exception as error:  # noqa: BLE001  (the page is a view: a worker lost meanwhile must not
            # fail the step; the trainer's own checks deal with the loss)
            logging.getLogger("taskrt").warning("dashboard page not updated: %r", error)


def profile_data(profile) -> dict:
    """The last profiled step as plain data for the page: one row per device and source (measured
    above simulated), its spans as bars (ms from the step's start) in the Gantt chart's bands and
    colors (taskrt.observing.gantt)."""
    from taskrt.observing.gantt import BANDS, span_color

    step = profile.last
    timelines = [t for t in (step, profile.simulated_at(step)) if t is not None]
    rows = [f"device {d} {t.source}" for d in step.devices for t in timelines]
    bottom = {row: len(rows) - 1 - i for i, row in enumerate(rows)}  # the first row on top
    bars = {k: [] for k in ("row", "lane", "name", "left", "right", "y", "height", "color")}
    for timeline in timelines:
        for span in [s for s in timeline.spans if s.lane in BANDS][:MAX_SPANS_SHOWN // len(timelines)]:
            offset, height = BANDS[span.lane]
            row = f"device {span.device} {timeline.source}"
            for k, v in (("row", row), ("lane", span.lane), ("name", span.name),
                         ("left", (span.start_s - timeline.start_s) * 1e3),
                         ("right", (span.end_s - timeline.start_s) * 1e3),
                         ("y", bottom[row] + offset + height / 2), ("height", height), ("color", span_color(span))):
                bars[k].append(v)
    return {"step": step.step, "rows": rows, "bars": bars,
            "walls_ms": {t.source: t.wall_s * 1e3 for t in timelines}}


# ---- the Bokeh page (runs in the scheduler) ---------------------------------------------------
SPLIT_COLORS = {"": "#d9d9d9", "n": "#4c72b0", "c": "#dd8452", "h": "#55a868", "w": "#c44e52"}


def _split_name(degrees: dict) -> str:
    return " ".join(f"{dim}={deg}" for dim, deg in degrees.items() if deg > 1) or "one part"


def _color(degrees: dict) -> str:
    dims = [dim for dim, deg in degrees.items() if deg > 1]
    return SPLIT_COLORS[dims[0]] if len(dims) == 1 else ("#8172b3" if dims else SPLIT_COLORS[""])


def grid_columns(data: dict) -> dict:
    """Cells of the layers x devices grid: one per (layer, device) a part of the layer runs on."""
    cols = {k: [] for k in ("layer", "device", "color", "label", "split")}
    for layer in data["layers"]:
        for part, device in enumerate(layer["devices"]):
            cols["layer"].append(layer["name"])
            cols["device"].append(data["devices"][device])
            cols["color"].append(_color(layer["degrees"]))
            cols["label"].append(f"part {part}")
            cols["split"].append(_split_name(layer["degrees"]) + (f" ({layer['sync']})" if layer["sync"] != "ps"
                                                                    else ""))
    return cols


def bytes_columns(data: dict) -> dict:
    pairs = sorted(set(data["planned_bytes"]) | set(data["measured_bytes"] or {}))
    measured = data["measured_bytes"] or {}
    return {"pair": pairs, "planned": [data["planned_bytes"].get(p, 0) for p in pairs],
            "measured": [measured.get(p, 0) for p in pairs]}


def strategy_doc(scheduler, extra, doc):
    from bokeh.layouts import column, row
    from bokeh.models import ColumnDataSource, Div, FactorRange, HoverTool, NumeralTickFormatter, Span
    from bokeh.plotting import figure
    from bokeh.transform import dodge

    doc.title = "taskrt: strategy"
    header = Div(text="<h2>taskrt</h2><p>No trainer has published to this scheduler yet.</p>", width=1300)
    grid = ColumnDataSource(grid_columns({"layers": [], "devices": []}))
    pairs = ColumnDataSource({"pair": [], "planned": [], "measured": []})
    steps = ColumnDataSource({"step": [], "ms": []})

    grid_fig = figure(title="layers x devices: where each layer's parts run (color: split dimension)",
                      x_range=FactorRange(), y_range=FactorRange(), width=700, height=420, toolbar_location=None)
    grid_fig.rect("device", "layer", 0.92, 0.85, source=grid, color="color", alpha=0.85)
    grid_fig.text("device", "layer", text="split", source=grid, text_align="center", text_baseline="middle",
                  text_font_size="9pt", text_color="white")
    grid_fig.add_tools(HoverTool(tooltips=[("layer", "@layer"), ("device", "@device"), ("split", "@split"),
                                           ("", "@label")]))
    grid_fig.xaxis.axis_label = "device"

    bytes_fig = figure(title="bytes per device pair per step: planned vs measured (transfer logs)",
                       x_range=FactorRange(), width=560, height=420, toolbar_location=None)
    bytes_fig.vbar(x=dodge("pair", -0.17, range=bytes_fig.x_range), top="planned", width=0.3, source=pairs,
                   color="#4c72b0", legend_label="planned")
    bytes_fig.vbar(x=dodge("pair", 0.17, range=bytes_fig.x_range), top="measured", width=0.3, source=pairs,
                   color="#dd8452", legend_label="measured")
    bytes_fig.add_tools(HoverTool(tooltips=[("pair", "@pair"), ("planned", "@planned{0,0}"),
                                            ("measured", "@measured{0,0}")]))
    bytes_fig.xaxis.axis_label = "source -> destination device"
    bytes_fig.yaxis.axis_label = "bytes"
    bytes_fig.yaxis.formatter = NumeralTickFormatter(format="0,0")
    bytes_fig.legend.orientation = "horizontal"  # below the bars, which reach the top when planned = measured
    bytes_fig.add_layout(bytes_fig.legend[0], "below")

    time_fig = figure(title="step time: measured vs predicted", width=1280, height=260, toolbar_location=None)
    time_fig.line("step", "ms", source=steps, color="#4c72b0", legend_label="measured")
    time_fig.scatter("step", "ms", source=steps, color="#4c72b0", size=3)
    predicted = Span(location=0, dimension="width", line_color="#c44e52", line_dash="dashed", line_width=2,
                     visible=False)
    time_fig.add_layout(predicted)
    # the Span's legend entry: a line with one NaN point draws nothing on the plot but its legend sample
    time_fig.line(x=[float("nan")], y=[float("nan")], line_color="#c44e52", line_dash="dashed", line_width=2,
                  legend_label="predicted (the plan simulated with measured costs)")
    time_fig.legend.orientation, time_fig.legend.location = "horizontal", "top_left"
    time_fig.xaxis.axis_label = "step"
    time_fig.yaxis.axis_label = "ms"

    bars = ColumnDataSource({k: [] for k in ("row", "lane", "name", "left", "right", "y", "height", "color")})
    gantt_fig = figure(title="last profiled step: per device, measured above simulated (Trainer.profile)",
                       width=1280, height=300, toolbar_location=None, visible=False)
    gantt_fig.hbar(y="y", left="left", right="right", height="height", color="color", source=bars)
    gantt_fig.add_tools(HoverTool(tooltips=[("", "@row"), ("", "@lane: @name"), ("ms", "@left{0.00} - @right{0.00}")]))
    gantt_fig.xaxis.axis_label = "ms from the step's start"
    gantt_fig.ygrid.grid_line_color = None

    shown = {"updated": None, "profile": None}

    def update():
        profiled = scheduler.get_metadata([PROFILE_KEY], default=None)
        if profiled and profiled["updated"] != shown["profile"]:
            shown["profile"] = profiled["updated"]
            _show_profile(gantt_fig, bars, profiled)
        data = scheduler.get_metadata([METADATA_KEY], default=None)
        if not data or data.get("updated") == shown["updated"]:
            return
        shown["updated"] = data["updated"]
        header.text = _header(data)
        cells = grid_columns(data)
        grid_fig.y_range.factors = [layer["name"] for layer in reversed(data["layers"])]
        grid_fig.x_range.factors = list(data["devices"])
        grid.data = cells
        cols = bytes_columns(data)
        bytes_fig.x_range.factors = cols["pair"]
        pairs.data = cols
        steps.data = {"step": [s for s, _ in data["step_times"]], "ms": [t * 1e3 for _, t in data["step_times"]]}
        if data.get("predicted_step_s"):
            predicted.location, predicted.visible = data["predicted_step_s"] * 1e3, True

    update()
    doc.add_periodic_callback(update, 1000)
    doc.add_root(column(header, row(grid_fig, bytes_fig), gantt_fig, time_fig))


def _show_profile(fig, bars, profile: dict):
    from bokeh.models import FixedTicker

    rows = profile["rows"]
    fig.yaxis.ticker = FixedTicker(ticks=[len(rows) - 1 - i + 0.5 for i in range(len(rows))])
    fig.yaxis.major_label_overrides = {len(rows) - 1 - i + 0.5: row for i, row in enumerate(rows)}
    fig.height = 90 + 45 * len(rows)
    walls = ", ".join(f"{source} {ms:.1f} ms" for source, ms in profile["walls_ms"].items())
    fig.title.text = f"last profiled step (step {profile['step']}): per device, measured above simulated; {walls}"
    bars.data = profile["bars"]
    fig.visible = True


def _header(data: dict) -> str:
    measured = data["measured_bytes"]
    agree = ""
    if measured is not None:
        same = measured == data["planned_bytes"]
        agree = (f"; measured bytes (step {data['measured_step']}) "
                 + ("equal the plan" if same else "<b>differ from the plan</b>"))
    times = [t for _, t in data["step_times"]]
    timing = ""
    if times:
        recent = sorted(times[-50:])[len(times[-50:]) // 2]
        timing = f"; median of the last {len(times[-50:])} steps {recent * 1e3:.1f} ms"
        if data.get("predicted_step_s"):
            timing += f", predicted {data['predicted_step_s'] * 1e3:.1f} ms"
    recoveries = "".join(
        f"<li>at step {r['at_step']}: lost device(s) {r['lost_devices']}, now on {r['devices']}, "
        f"restored step {r['snapshot_step']}, replayed {r['replayed']} step(s)</li>" for r in data["recoveries"])
    return (f"<h2>taskrt: {data['graph']} under strategy {data['strategy'] or '(unnamed)'}</h2>"
            f"<p>{data['machine']}; {data['steps_done']} steps{agree}{timing}</p>" + _memory_line(data)
            + (f"<p>recoveries from lost workers:</p><ul>{recoveries}</ul>" if recoveries else ""))


def _memory_line(data: dict) -> str:
    """Each device's predicted step peak, the last step's measured one and its memory, in MiB."""
    def mib(b):
        return "?" if b is None else f"{b / 2**20:,.1f}"

    rows = data.get("memory") or []
    if not rows:
        return ""
    cells = "; ".join(f"device {d}: {mib(p)} / {mib(m)}" + (f" of {mib(c)}" if c else "") for d, p, m, c in rows)
    return f"<p>memory per step, predicted / measured MiB: {cells}</p>"


def register() -> None:
    """Add the page to the scheduler dashboard's applications (before the scheduler starts)."""
    try:
        from distributed.dashboard.scheduler import applications
    except ImportError:  # no bokeh: the dashboard itself is off
        return
    applications.setdefault(PATH, strategy_doc)


register()

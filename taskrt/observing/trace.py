"""Profiled steps in the Chrome trace event format (JSON), which Perfetto (ui.perfetto.dev) and
chrome://tracing open.

    write_trace(profile, "trace.json")

One process per device and source: pid = device for the measured timeline ("device 0 (measured)"),
SIMULATED_PID + device for the simulated one ("device 0 (simulated)"), sorted so that each device's
two processes sit one above the other.  One thread per lane of `taskrt.observing.timeline` (kernels, data,
transfers in, transfers out, waiting, dask tasks) and one for the steps themselves.  Every event
is complete ("X", with its duration), metadata ("M") or, for each device's memory, a counter ("C":
at each measured step's start, the peak its worker measured in the step beside the predicted
peak, MiB); times are microseconds from the first profiled step's start.  The simulated step is
laid at the start of each measured step.
"""

from __future__ import annotations

import json

from taskrt.observing.timeline import LANES

SIMULATED_PID = 1000
STEP_LANE = "steps"
THREADS = (STEP_LANE, *LANES)  # tid = position + 1


def pid_of(device: int, source: str) -> int:
    return device if source == "measured" else SIMULATED_PID + device


def tid_of(lane: str) -> int:
    return THREADS.index(lane) + 1


def trace_events(profile) -> list[dict]:
    """The trace's events: metadata naming every process and thread, then each step's spans."""
    events = []
    devices = profile.last.devices
    sources = ("measured", "simulated") if profile.simulated is not None else ("measured",)
    for device in devices:
        for i, source in enumerate(sources):
            pid = pid_of(device, source)
            events.append(_meta("process_name", pid, 0, name=f"device {device} ({source})"))
            events.append(_meta("process_sort_index", pid, 0, sort_index=2 * device + i))
            events.append(_meta("process_labels", pid, 0, labels=profile.device_names[device]))
            for lane in THREADS:
                events.append(_meta("thread_name", pid, tid_of(lane), name=lane))
                events.append(_meta("thread_sort_index", pid, tid_of(lane), sort_index=tid_of(lane)))
    for step in profile.measured:
        for timeline in (step, profile.simulated_at(step)):
            if timeline is None:
                continue
            for device in timeline.devices:
                events.append(_complete(f"step {step.step}", STEP_LANE, pid_of(device, timeline.source),
                                        timeline.start_s, timeline.end_s, {"wall ms": round(timeline.wall_s * 1e3, 3)}))
            for span in timeline.spans:
                events.append(_complete(span.name, span.lane, pid_of(span.device, timeline.source), span.start_s,
                                        span.end_s, {"step": step.step, **dict(span.detail)}))
    for k, step in enumerate(profile.measured):
        for device, memory in (profile.memory or {}).items():
            measured = memory["measured"][k] if k < len(memory["measured"]) else None
            values = {"predicted": round(memory["predicted"] / 2**20, 3)}
            if measured is not None:
                values["measured"] = round(measured / 2**20, 3)
            events.append({"ph": "C", "name": "memory peak (MiB)", "pid": pid_of(device, "measured"),
                           "tid": tid_of(STEP_LANE), "ts": round(step.start_s * 1e6, 3), "args": values})
    return events


def chrome_trace(profile) -> dict:
    """The whole trace file's object."""
    return {
        "traceEvents": trace_events(profile),
        "displayTimeUnit": "ms",
        "otherData": {
            "graph": profile.graph, "strategy": profile.strategy, "machine": profile.machine,
            "losses": list(profile.losses), "measured_step_ms": [s.wall_s * 1e3 for s in profile.measured],
            "simulated_step_ms": None if profile.simulated is None else profile.simulated.wall_s * 1e3,
            "memory_bytes": {str(d): m for d, m in (profile.memory or {}).items()},
        },
    }


def write_trace(profile, path) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(profile), f)


def _meta(kind: str, pid: int, tid: int, **args) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "ts": 0, "args": args}


def _complete(name: str, lane: str, pid: int, start_s: float, end_s: float, args: dict) -> dict:
    return {"ph": "X", "name": name, "cat": lane, "pid": pid, "tid": tid_of(lane), "ts": round(start_s * 1e6, 3),
            "dur": round(max(end_s - start_s, 0.0) * 1e6, 3), "args": args}

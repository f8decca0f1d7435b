"""Seeing where a step's time goes: per-device timelines measured or simulated (`timeline`), Chrome
traces (`trace`), Gantt charts (`gantt`), every task timed where it runs (`task_timing`), profiled
steps (`profile`) and the taskrt page of the Dask dashboard (`dashboard`).

Imports the rooms below it (ops, graph, gpu, data, planning); the executor and the cluster use it."""

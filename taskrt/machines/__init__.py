"""Machines and clusters: `Machine` (devices, links; local, from a client, simulated), the devices
and their resource tags (`devices`), starting a local cluster (`local_cluster`, `batching`), what
every worker does once (`worker_setup`), probing links (`link_probe`), measuring the runtime's
costs (`calibration`) and data sheets of simulated device kinds (`device_kinds`).

Imports the rooms below it (ops, gpu, planning, observing, transport)."""

"""Plans run on Dask: a Dask task per fused run (`executor`) or one program per device and step
(`program_executor`, the default), each pinned to its device's resource tag.

Imports the rooms below it (ops, gpu, data, planning, observing, transport, machines)."""

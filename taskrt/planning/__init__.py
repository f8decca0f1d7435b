"""(graph, strategy) -> Plan, and everything computed from a plan without a cluster: the lowering
(`lowering`, from the ops' region rules), the plan itself as plain data (`plan`, `tasks`,
`params`), fusing a device's runs between waits (`fusion`), one program per device (`programs`),
memory per device (`memory`), the list-scheduling simulator (`simulate`) and a plan run in this
process (`inprocess`).

Imports `taskrt.ops`, `taskrt.graph`, `taskrt.gpu` and `taskrt.data` below it; never Dask."""

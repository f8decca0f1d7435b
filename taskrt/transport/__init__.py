"""Moving values: from one device's program to another's (`mailbox`, over distributed's comms,
`local_link`'s own sockets, `shared_memory` on one host, `gpu_ipc` between GPUs of one host) and
a step's losses from the workers to the client (`worker_reads`).  This is where a message between
two workers is sent.

Imports the rooms below it (ops, gpu, planning)."""

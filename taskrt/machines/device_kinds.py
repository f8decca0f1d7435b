"""Data sheets of device kinds that are not here, for Machine.simulated: peak float32 FLOP/s,
memory bandwidth and memory, and the links between them.  The cost model says so wherever it
uses them (roofline estimates)."""

DEVICE_KINDS = {
    "P100": {"flops": 9.3e12, "memory_bandwidth": 732e9, "memory": 16e9},
    "V100": {"flops": 14.0e12, "memory_bandwidth": 900e9, "memory": 16e9},
    "A100": {"flops": 19.5e12, "memory_bandwidth": 1555e9, "memory": 40e9},
    # SplitBrain's nodes (seed 000): one 8-core 2.2 GHz Ivy Bridge Xeon, AVX (8-wide fp32 add and
    # multiply each cycle: 16 FLOP/cycle/core), four DDR3-1600 channels, 64 GB
    "IvyBridge-8c": {"flops": 8 * 2.2e9 * 16, "memory_bandwidth": 4 * 12.8e9, "memory": 64e9},
    # Cori's KNL nodes (seed 001): Xeon Phi 7250, 68 cores x 1.4 GHz x 64 fp32 FLOP/cycle, 16 GB MCDRAM
    "KNL-7250": {"flops": 68 * 1.4e9 * 64, "memory_bandwidth": 400e9, "memory": 16e9},
    # The nodes of seed 003: two 28-core 2.5 GHz Xeon Platinum 8180 (Skylake, 112 threads), AVX-512
    # with two FMA units (64 fp32 FLOP/cycle/core), six DDR4-2666 channels per socket
    "SKL-8180x2": {"flops": 2 * 28 * 2.5e9 * 64, "memory_bandwidth": 2 * 6 * 21.33e9, "memory": 192e9},
}
NVLINK = 20e9  # bytes/s, one P100 NVLink direction
INFINIBAND_100G = 12.5e9  # bytes/s, 100 Gb/s EDR

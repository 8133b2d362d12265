"""NVIDIA GPU support: inventory (NVML), the driver's checkpoint API, quiesce."""

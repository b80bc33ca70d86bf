"""The preprocessing pool: decode + the HF processor in child processes, results through /dev/shm."""

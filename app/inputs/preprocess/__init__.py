"""The preprocessing pool: decode + the HF processor in spawned processes, results through /dev/shm."""

"""What touches the host: configuration, GPUs and NVML, the store, the lock file, systemd, logs, metrics."""

"""The daemon's clients: gpuctl, top, the demo, and a helper that starts a daemon process."""

"""gpud: a per-node daemon that shares a machine's GPUs among processes."""

__version__ = "0.1.0"
__all__ = ["__version__"]

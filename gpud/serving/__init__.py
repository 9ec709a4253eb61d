"""The serving runtime, above the capabilities: the listener, connections, timers, the monitor, and
the daemon (``server``) that builds the kit and wires the capabilities onto it."""

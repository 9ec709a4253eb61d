"""The serving shell: connections, timers, the daemon that wires the capabilities, and what they share."""

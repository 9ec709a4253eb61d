"""Whole-daemon simulations on fake time (see ``daemon_sim``)."""

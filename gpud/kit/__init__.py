"""The kit: the pieces every capability handler is given, below the capabilities.

``parts`` (what a handler is handed), ``state`` (a client's connection, a GPU slot, the clock,
GPU references), ``links`` (the connection registry and the send path), ``effects`` (the one way
the cores' effects are carried out), ``faults`` (a fault logged once, counted, contained) and
``access`` (admin rights, priority ceilings). The kit imports the core and the host, never a
capability or the serving runtime above them.
"""

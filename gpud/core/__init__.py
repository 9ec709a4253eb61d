"""The pure core: state machines on injected integer time (microseconds).

No I/O, no clock reads, no trio, no logging here: calls take ``now`` and
return effects for the shell to carry out.
"""

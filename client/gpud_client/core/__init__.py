"""The client core: every rule of the sync and asyncio clients, without I/O.

``ClientCore`` takes what happened and returns ``actions``; ``Client`` and
``AsyncClient`` are the drivers that carry them out. Nothing in this package
may import a socket, thread, asyncio, time, random or logging module (a test
checks the imports).
"""

from gpud_client.core.actions import reconnect_delay
from gpud_client.core.client import ClientCore
from gpud_client.core.session import SessionState
from gpud_client.core.slices import HOLD, UNARBITRATED

__all__ = ["HOLD", "UNARBITRATED", "ClientCore", "SessionState", "reconnect_delay"]

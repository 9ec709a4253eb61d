"""Who may do what: admin rights and priority ceilings, from the peer's credentials.

The rules are in ``gpud.core.authority``; this module resolves the configured
group names once (at start and on reload) and answers for a connection.
"""

from __future__ import annotations

import grp
import os

import msgspec
import structlog

from gpud.core.authority import PriorityRules, check_priority, lease_priority, priority_ceiling
from gpud.core.errors import Refused
from gpud.core.leases import LeasePolicy
from gpud.host.config import Config
from gpud.kit.state import ClientLink
from gpud_client import protocol as p

log = structlog.get_logger(__name__)


class Access:
    def __init__(self, config: Config) -> None:
        self.daemon_uid = os.getuid()
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        self.admin_gid = group_id(config.admin_group) if config.admin_group else None
        by_gid = {gid: cap for name, cap in config.priority_max_groups.items() if (gid := group_id(name)) is not None}
        self.priority_rules = PriorityRules(
            default_max=config.priority_max,
            by_uid={int(u): cap for u, cap in config.priority_max_uids.items()},
            by_gid=by_gid,
        )
        rules = self.priority_rules  # nobody's ceiling is below this: a lease at or under it needs no look-up
        self.lowest_ceiling = min([rules.default_max, *rules.by_uid.values(), *rules.by_gid.values()])

    def is_admin(self, conn: ClientLink) -> bool:
        """uid 0, the daemon's own uid, or a member of ``admin_group``; never a connection on a task's
        own socket (root in a container is no admin of the node)."""
        if conn.scope is not None:
            return False
        if conn.uid == 0 or conn.uid == self.daemon_uid:
            return True
        gid = self.admin_gid
        return gid is not None and (conn.gid == gid or gid in conn.groups)

    def require_admin(self, conn: ClientLink, msg: msgspec.Struct) -> None:
        if not self.is_admin(conn):
            raise Refused(
                p.ErrorCode.PERMISSION_DENIED,
                f"{msg.__struct_config__.tag} needs uid 0, the daemon's uid or the admin group (peer uid {conn.uid})",
            )

    def priority_ceiling(self, conn: ClientLink) -> int:
        return priority_ceiling(self.priority_rules, conn.uid, conn.groups | {conn.gid}, admin=self.is_admin(conn))

    def check_priority(self, conn: ClientLink, asked: int | None, what: str) -> None:
        """Refuse a declared priority above the peer's ceiling (none declared: nothing to look up)."""
        if asked is not None:
            check_priority(asked, self.priority_ceiling(conn), what)

    def lease_priority(self, conn: ClientLink, task_type: str, policy: LeasePolicy, priority: int) -> int:
        """What a lease of this peer runs at (``authority.lease_priority``); refuses a reserved type."""
        if not policy.reserved and priority <= self.lowest_ceiling:
            return priority
        groups = conn.groups | {conn.gid}
        return lease_priority(
            task_type,
            policy,
            priority,
            conn.uid,
            groups,
            admin=self.is_admin(conn),
            ceiling=self.priority_ceiling(conn),
        )


def group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        log.info("group_missing", group=name)
        return None

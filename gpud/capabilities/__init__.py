"""One request handler per capability: locks, leases, allocations, admin, status."""

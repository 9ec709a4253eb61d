"""The allocation rules' settings, from gpud's configuration (at start and on each reload)."""

from __future__ import annotations

from gpud.core.ledger import PreemptionConfig, TenantQuota, to_fixed
from gpud.host.config import Config


def preemption_config(config: Config) -> PreemptionConfig:
    return PreemptionConfig(
        grace_us=round(config.preemption_grace_s * 1e6),
        min_runtime_us=round(config.preemption_min_runtime_s * 1e6),
        strategy=config.preemption_strategy,
        cooldown_us=round(config.preemption_cooldown_s * 1e6),
        elastic_cooldown_us=round(config.elastic_cooldown_s * 1e6),
        elastic_window_us=round(config.elastic_window_s * 1e6),
        busy_percent=config.elastic_busy_percent,
        enabled=config.preemption,
    )


def tenant_quotas(config: Config) -> dict[str, TenantQuota]:
    return {name: TenantQuota(to_fixed(t.gpus), to_fixed(t.borrow)) for name, t in config.tenants.items()}

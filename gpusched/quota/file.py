"""Where the quota policy (partition shares, tenant budgets) is configured, and reading it.

One file for every process that needs the policy (fleet API, pool sync, executor):
``$GPUSCHED_QUOTA_FILE``, else ``$AIRFLOW_HOME/gpusched/quota.yaml``, in the format of
:meth:`gpusched.quota.policy.QuotaPolicy.from_dict`::

    shares: {training: 70, burst: 20, dev: 10}   # percent of in-service capacity
    borrowing: true
    budgets: {vision: 500, nlp: 200}             # A100-equivalent GPU-hours per period
    default_budget: 50                           # tenants not listed (omit: unlimited)
    period_s: 2592000

Without a file the defaults apply (70/20/10, borrowing on, no budgets).
"""

from __future__ import annotations

import os
from pathlib import Path

from gpusched.errors import ConfigurationError
from gpusched.paths import state_dir
from gpusched.quota.policy import QuotaPolicy

__all__ = ["load_quota_policy", "quota_file", "read_quota_policy"]


def quota_file() -> Path:
    """The path the quota policy is read from (it may not exist)."""
    return Path(os.environ.get("GPUSCHED_QUOTA_FILE") or state_dir() / "quota.yaml")


def load_quota_policy() -> QuotaPolicy:
    """The configured quota policy, or the defaults when :func:`quota_file` does not exist.

    Raises:
        ConfigurationError: the file exists but is not a valid policy (the message says why).
    """

    path = quota_file()
    if not path.is_file():
        return QuotaPolicy()
    return read_quota_policy(path)


def read_quota_policy(path: Path) -> QuotaPolicy:
    """The quota policy in file ``path``.

    Raises:
        ConfigurationError: the file is missing or not a valid policy (the message says why).
    """
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigurationError(f"quota file {path} cannot be read ({exc}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise ConfigurationError(f"quota file {path} must hold a mapping (shares, budgets, …)")
    return QuotaPolicy.from_dict(data)

"""Layer-wise KV prefetch for forwards that continue a context (schedule.py) and the policy that
chooses it over the CPU workers (policy.py)."""

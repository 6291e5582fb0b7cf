"""The scheduler service: batching, the KV cache and the forward loop (`python -m services.scheduler`)."""

from services.scheduler import omp_env

omp_env.apply()

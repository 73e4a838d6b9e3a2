"""The intermediate result pool between routers and verifiers (Minions 3.4).

Drafts wait for a verifier, results wait for their router, request state survives crashes.
`RedisPool` (Redis streams + consumer groups) is the distributed one; `MemoryPool` serves the
embedded mode with the same contract (tests/test_pool_contract.py runs against both).
"""
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specmesh_services.common.pool.base import Pool, Taken
from specmesh_services.common.pool.memory import MemoryPool

# what a call raises while the pool is unreachable (Redis restarting): worth a retry
POOL_DOWN = (ConnectionError, OSError, RedisConnectionError, RedisTimeoutError)


def connect(redis_url: str | None, prefix: str = "specmesh") -> Pool:
    """A RedisPool on `redis_url`, or a MemoryPool when it is None."""
    if redis_url is None:
        return MemoryPool()
    from specmesh_services.common.pool.redis import RedisPool

    return RedisPool(redis_url, prefix=prefix)


__all__ = ["POOL_DOWN", "MemoryPool", "Pool", "Taken", "connect"]

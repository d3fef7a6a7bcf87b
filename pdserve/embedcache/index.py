"""The embedding-cache index in Redis: cache key -> where the embedding bytes live.

One Redis hash per key, ``{prefix}{key}``, with a TTL equal to the producer's lease on the bytes:
when the producer stops refreshing (it died, or evicted the entry), the entry expires with it,
so a consumer never reads an address whose owner is gone for longer than one lease.

    field    value
    -------  ------------------------------------------------------------
    owner    producer node name
    addr     Mooncake TE address of the producer ("host:port")
    base     registered buffer address of the bytes (int)
    nbytes   size in bytes (int)
    dtype    "float32" | "bfloat16" | "float16"
    shape    "T,H" (placeholder length, hidden size)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class EmbeddingEntry:
    key: str  # content hash of the image bytes, or "uuid:<client uuid>"
    owner: str  # producer node name
    addr: str  # producer's transfer-engine address
    base: int  # address of the bytes in the producer's registered memory
    nbytes: int
    dtype: str
    shape: tuple[int, int]  # (placeholder length, hidden)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"embedding dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        want = self.shape[0] * self.shape[1] * DTYPE_BYTES[self.dtype]
        assert self.nbytes == want, f"entry {self.key}: {self.nbytes} bytes for {self.shape} {self.dtype}"

    def to_fields(self) -> dict[str, str]:
        return {
            "owner": self.owner,
            "addr": self.addr,
            "base": str(self.base),
            "nbytes": str(self.nbytes),
            "dtype": self.dtype,
            "shape": f"{self.shape[0]},{self.shape[1]}",
        }

    @classmethod
    def from_fields(cls, key: str, f: dict[str, str]) -> EmbeddingEntry:
        t, h = (int(x) for x in f["shape"].split(","))
        return cls(key, f["owner"], f["addr"], int(f["base"]), int(f["nbytes"]), f["dtype"], (t, h))


class EmbeddingIndex:
    """Reads and writes entries; every write sets the entry's expiry (``ttl_s``) atomically with it.

    ``client`` is a ``redis.Redis`` with ``decode_responses=True``."""

    def __init__(self, client: Any, prefix: str = "pdserve:ec:") -> None:
        self.client = client
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str, prefix: str = "pdserve:ec:") -> EmbeddingIndex:
        import redis

        return cls(redis.Redis.from_url(url, decode_responses=True, socket_timeout=5.0), prefix)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def publish(self, entry: EmbeddingEntry, ttl_s: float) -> None:
        assert ttl_s > 0, ttl_s
        pipe = self.client.pipeline(transaction=True)  # MULTI: never an entry without expiry
        pipe.delete(self._k(entry.key))
        pipe.hset(self._k(entry.key), mapping=entry.to_fields())
        pipe.pexpire(self._k(entry.key), int(ttl_s * 1000))
        pipe.execute()

    def lookup(self, key: str) -> EmbeddingEntry | None:
        fields = self.client.hgetall(self._k(key))
        return EmbeddingEntry.from_fields(key, fields) if fields else None

    def refresh(self, key: str, ttl_s: float) -> bool:
        """Extend an entry's lease; False if it has already expired."""
        return bool(self.client.pexpire(self._k(key), int(ttl_s * 1000)))

    def remove(self, key: str) -> None:
        self.client.delete(self._k(key))

    def keys(self) -> list[str]:
        """Every live key (tests and metrics; SCAN, never KEYS)."""
        n = len(self.prefix)
        return sorted(k[n:] for k in self.client.scan_iter(match=self.prefix + "*", count=500))

"""An adapter's identity ``name@hex(content hash)`` and the block-hash salt it stands for.

The engine salts every block hash of a request under an adapter with the adapter's content
hash (``LoRAServing.admit`` prefixes ``Request.cache_salt``), so prefix-cache blocks never match
across adapters; the router hashes an adapter's prompt with the same bytes, so the blocks it
believes a node holds (KV events, prefix affinity) are the ones that node computed under that
adapter. No torch here: the router imports it.
"""

from __future__ import annotations

from collections.abc import Mapping


def adapter_ident(name: str, content_hash: bytes) -> str:
    return f"{name}@{content_hash.hex()}"


def ident_salt(ident: str) -> bytes:
    """The content hash of ``name@hex`` (what the engine's block hashes of the adapter carry)."""
    name, sep, digest = ident.rpartition("@")
    assert sep and name, ident
    return bytes.fromhex(digest)


def lora_block_salt(idents: Mapping[str, str], lora_name: str) -> bytes | None:
    """The extra bytes of a request's block hashes: b"" for the base model, the adapter's content
    hash, or None while its identity is not known (then no block hashes are made)."""
    if not lora_name:
        return b""
    ident = idents.get(lora_name)
    return None if ident is None else ident_salt(ident)

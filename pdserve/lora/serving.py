"""LoRAServing: the engine's view of its adapters (load, unload once unused, request checks,
per-adapter counters). The slot stacks live in the model runner's LoRAManager."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.request import Request
from pdserve.errors import ConfigError, InvalidRequestError
from pdserve.lora.manager import LoRAManager
from pdserve.lora.peft import LoRAAdapter, LoRAAdapterError

if TYPE_CHECKING:
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.scheduler import Scheduler


def make_lora_serving(runner: object, config: EngineConfig, scheduler: Scheduler) -> LoRAServing | None:
    """The engine's LoRAServing (its start-up adapters loaded), or None without lora settings."""
    if config.lora is None:
        return None
    manager = getattr(runner, "lora", None)
    assert isinstance(manager, LoRAManager), type(runner)  # EngineConfig refuses TP / PP with lora
    scheduler.max_loras = config.lora.max_loras
    serving = LoRAServing(manager)
    for name, path in config.lora.modules:
        try:
            serving.load(name, path)
        except LoRAAdapterError as e:
            raise ConfigError(f"lora.modules {name!r}: {e}") from e
    return serving


class LoRAServing:
    """Mutates the manager's registry; lives on the engine thread (every call is made there)."""

    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.unloading: set[str] = set()  # unloaded while requests used them: removed when they end
        self.requests_total: Counter[str] = Counter()  # admitted requests per adapter
        # name -> ident of the adapters requests may use, replaced whole (never mutated) after
        # every change, so other threads (the node's load reports) read it without a lock
        self.published_idents: dict[str, str] = {}
        self._publish()

    def _publish(self) -> None:
        self.published_idents = {n: self.ident(n) for n in self.names()}

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load (or find the same content already loaded); a new load cancels a pending unload."""
        adapter = self.manager.add_adapter(name, path)
        self.unloading.discard(name)
        self._publish()
        return adapter

    def unload(self, name: str, live: Iterable[Request]) -> bool:
        """Unload ``name``: at once if no live request uses it (True), else once they end (False);
        new requests for it are refused from now on."""
        self.manager.get(name)  # InvalidRequestError when unknown
        if name in self.unloading:
            raise InvalidRequestError(f"lora_name {name!r} is already being unloaded", field="lora_name")
        if any(r.lora_name == name for r in live):
            self.unloading.add(name)
            self._publish()
            return False
        self.manager.remove_adapter(name)
        self._publish()
        return True

    def reap(self, live: Iterable[Request]) -> None:
        """Remove the adapters being unloaded that no live request uses any more."""
        if not self.unloading:
            return
        used = {r.lora_name for r in live}
        done = sorted(self.unloading - used)
        for name in done:
            self.unloading.discard(name)
            self.manager.remove_adapter(name)
        if done:
            self._publish()

    def admit(self, name: str) -> bytes:
        """The adapter's content hash (it salts the request's block hashes), or an error for an
        adapter that is not loaded or is being unloaded."""
        if name in self.unloading:
            raise InvalidRequestError(f"model {name!r}: the LoRA adapter is being unloaded", field="model")
        adapter = self.manager.get(name)
        self.requests_total[name] += 1
        return adapter.content_hash

    def names(self) -> list[str]:
        return [n for n in self.manager.adapters if n not in self.unloading]

    def ident(self, name: str) -> str:
        return self.manager.get(name).ident

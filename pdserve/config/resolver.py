"""Derived settings: the one place that turns a node's roles into the settings that follow.

docs/design.md §1: derived settings are derived, never hand-set. :func:`resolve_node_settings`
assigns them unconditionally; where that replaces a value written in the file it logs a
warning naming the node, the field, the hand-set value and the derived one.

    role       ec_role (derived)
    ---------  ----------------------------------------------------------
    prefill    ec_consumer if the model is multimodal and an encoder serves it
    colocated  same as prefill (it prefills too)
    decode     None
    encoder    ec_producer

    accept_mm_embeds = allow_missing_mm_embeds = ec_consumer or (KV consumer of a multimodal model)
    where a KV consumer is a decode or colocated node (its KV, images included, may come from a
    prefill node). accept_mm_embeds is only ever turned on: a hand-set True stays True even where
    it is not derived.

The KV role follows from the role alone (``KV_ROLE_OF_ROLE``); the file may restate it, and a
contradicting ``kv_role`` is refused at load (:class:`~pdserve.config.node_settings.NodeConfig`).

Role-derived defaults (a value written in the file wins; these fill only what it leaves out):

    max_num_batched_tokens   prefill: PREFILL_MAX_NUM_BATCHED_TOKENS (16,384): a prefill node's
                             steps are all prompt tokens, and larger steps run closer to the
                             tensor cores' peak; colocated / decode / encoder:
                             DEFAULT_MAX_NUM_BATCHED_TOKENS (2,048), which bounds the
                             inter-token latency of the decodes that share a step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.config.choices import EcRole, Role
from pdserve.config.cluster import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    PREFILL_MAX_NUM_BATCHED_TOKENS,
    ClusterConfig,
    NodeConfig,
)
from pdserve.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

_MM_ARCH_MARKERS = ("Llava", "VL")


def checkpoint_is_multimodal(model: str) -> bool:
    """True when the checkpoint's ``config.json`` has a ``vision_config`` or a VLM architecture."""
    from pdserve.models.resolve import resolve_model_path

    path = resolve_model_path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(
            f"cannot tell whether model {model!r} is multimodal: {path} does not exist; "
            "point `model` at a Hugging Face checkpoint folder"
        ) from e
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if "vision_config" in cfg:
        return True
    archs = cfg.get("architectures") or []
    return any(marker in arch for arch in archs for marker in _MM_ARCH_MARKERS)


@dataclass(frozen=True)
class MmPolicy:
    """What a running node needs of its derived settings to judge a request's image items."""

    name: str
    role: Role
    ec_role: EcRole | None
    accept_mm_embeds: bool = False
    allow_missing_mm_embeds: bool = False


@dataclass(frozen=True)
class ResolvedNode:
    """One node's settings with every derived field assigned."""

    node: NodeConfig  # the file's entry, derived fields replaced
    cluster: ClusterConfig  # the whole file: peers, router, redis_url, shared_token
    served_model_name: str  # the node's model as clients name it
    is_multimodal: bool
    overridden: tuple[str, ...] = ()  # fields whose hand-set value was replaced (each logged)

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def role(self) -> Role:
        return self.node.role

    @property
    def ec_role(self) -> EcRole | None:
        return self.node.ec_role

    @property
    def accept_mm_embeds(self) -> bool:
        return self.node.accept_mm_embeds

    @property
    def allow_missing_mm_embeds(self) -> bool:
        return self.node.allow_missing_mm_embeds

    @property
    def max_num_batched_tokens(self) -> int:
        """The step's token budget: the file's value, else the role's default (module docstring)."""
        n = self.node.max_num_batched_tokens
        return n if n is not None else default_max_num_batched_tokens(self.role)

    @property
    def mm_policy(self) -> MmPolicy:
        return MmPolicy(
            self.name,
            self.role,
            self.ec_role,
            self.accept_mm_embeds,
            self.allow_missing_mm_embeds,
        )

    def engine_config(self, pipeline_rank: int = 0, seed: int = 0) -> EngineConfig:
        """The engine settings of this node (of pipeline stage ``pipeline_rank`` when pp > 1)."""
        n = self.node
        return EngineConfig(
            model=n.model,
            dtype=n.dtype,
            device=n.device,
            max_model_len=n.max_model_len,
            seed=seed,
            enforce_eager=n.enforce_eager,
            async_scheduling=n.async_scheduling,
            step_timeout_s=n.step_timeout_s,
            max_grammar_bytes=n.max_grammar_bytes,
            grammar_compile_timeout_s=n.grammar_compile_timeout_s,
            cpu_threads=n.cpu_threads,
            lora=self.cluster.lora.to_config() if self.cluster.lora is not None else None,
            speculative=n.speculative.engine_config() if n.speculative is not None else None,
            kv_offload=n.kv_offload_config(),
            cache=CacheConfig(
                block_size=n.block_size,
                kv_cache_memory_bytes=n.kv_cache_memory_bytes,
                gpu_memory_utilization=n.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=n.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_queue_len=n.max_queue_len,
                max_queue_wait_s=n.max_queue_wait_s,
            ),
            parallel=ParallelConfig(
                pipeline_parallel_size=n.pp,
                pipeline_rank=pipeline_rank,
                tensor_parallel_size=n.tp,
                pp_layer_split=n.pp_layer_split,
                prefill_context_parallel_size=n.pcp,
            ),
        )


def default_max_num_batched_tokens(role: Role) -> int:
    """The token budget of a node of ``role`` whose file entry sets none."""
    return PREFILL_MAX_NUM_BATCHED_TOKENS if role is Role.PREFILL else DEFAULT_MAX_NUM_BATCHED_TOKENS


def resolve_node_settings(
    cluster: ClusterConfig,
    node_name: str,
    *,
    is_multimodal: Callable[[str], bool] = checkpoint_is_multimodal,
) -> ResolvedNode:
    """Derive ``node_name``'s role-dependent settings (see the module docstring's table).

    ``is_multimodal(model)`` tells whether a checkpoint is a vision-language model; tests pass
    a lambda, nodes use :func:`checkpoint_is_multimodal` (reads ``config.json``).
    Raises ConfigError for an unknown node or an encoder node of a text-only model.
    """
    node = cluster.node(node_name)
    multimodal = is_multimodal(node.model)
    if node.role is Role.ENCODER and not multimodal:
        raise ConfigError(
            f"node {node.name!r} is an encoder but model {node.model!r} has no vision tower; "
            "give the encoder a multimodal checkpoint or remove the node"
        )
    has_encoder = any(e.model == node.model for e in cluster.encoder_nodes)
    ec_role: EcRole | None = None
    if node.role is Role.ENCODER:
        ec_role = EcRole.EC_PRODUCER
    elif node.role in (Role.PREFILL, Role.COLOCATED) and multimodal and has_encoder:
        ec_role = EcRole.EC_CONSUMER
    mm_embeds = ec_role is EcRole.EC_CONSUMER or (node.role.decodes and multimodal)

    defaults: dict[str, Any] = {}  # role-derived defaults: only where the file sets nothing
    if node.max_num_batched_tokens is None:
        defaults["max_num_batched_tokens"] = default_max_num_batched_tokens(node.role)
    derived: dict[str, Any] = {
        "ec_role": ec_role,
        # one direction only: deriving turns accept_mm_embeds on, never off
        "accept_mm_embeds": mm_embeds or node.accept_mm_embeds,
        "allow_missing_mm_embeds": mm_embeds,
    }
    overridden = []
    for field, value in derived.items():
        hand_set = getattr(node, field)
        # None roles mean "derive"; for the flags, any value written in the file counts as hand-set.
        written = field in node.model_fields_set and (hand_set is not None or field.endswith("_embeds"))
        if written and hand_set != value:
            logger.warning(
                "node %s: %s is hand-set to %r but derived as %r from its roles; using %r",
                node.name,
                field,
                hand_set,
                value,
                value,
            )
            overridden.append(field)
    return ResolvedNode(
        node=node.model_copy(update={**derived, **defaults}),
        cluster=cluster,
        served_model_name=cluster.served_name(node.model),
        is_multimodal=multimodal,
        overridden=tuple(overridden),
    )


def check_mm_items_allowed(
    node: ResolvedNode | MmPolicy, items_have_tensor: list[bool], field: str = "mm_items"
) -> None:
    """How a node acts on its derived flags, for a request's image items (True: the item carries
    its embedding tensor; False: only its cache key and placeholder length).

    - an item without its tensor needs ``allow_missing_mm_embeds`` (EC consumers fetch it from the
      embedding cache; decode never needs it, its KV already holds the image);
    - any embedding-only item needs ``accept_mm_embeds``.
    Raises InvalidRequestError (HTTP 400 at the router, INVALID_ARGUMENT between nodes)."""
    if not items_have_tensor:
        return
    if not node.accept_mm_embeds:
        raise InvalidRequestError(
            f"node {node.name!r} ({node.role}, ec_role={node.ec_role}) does not "
            "accept embedding-only image inputs (accept_mm_embeds is false: it is derived true for EC "
            "consumers and KV consumers of a multimodal model)",
            field=field,
        )
    missing = [i for i, has in enumerate(items_have_tensor) if not has]
    if missing and not node.allow_missing_mm_embeds:
        raise InvalidRequestError(
            f"node {node.name!r}: image items {missing} carry no embedding tensor, and this node "
            "does not allow missing tensors (allow_missing_mm_embeds is false); send the embeddings",
            field=field,
        )

from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = (
        "frequency_penalty",
        "ignore_eos",
        "include_stop_str_in_output",
        "logprobs",
        "max_tokens",
        "min_p",
        "min_tokens",
        "presence_penalty",
        "repetition_penalty",
        "seed",
        "skip_special_tokens",
        "stop",
        "stop_token_ids",
        "temperature",
        "top_k",
        "top_p",
    )
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    def __init__(
        self,
        temperature: float | None = ...,
        top_k: int | None = ...,
        top_p: float | None = ...,
        min_p: float | None = ...,
        seed: int | None = ...,
        max_tokens: int | None = ...,
        min_tokens: int | None = ...,
        stop: _Iterable[str] | None = ...,
        stop_token_ids: _Iterable[int] | None = ...,
        ignore_eos: bool | None = ...,
        logprobs: int | None = ...,
        repetition_penalty: float | None = ...,
        presence_penalty: float | None = ...,
        frequency_penalty: float | None = ...,
        include_stop_str_in_output: bool | None = ...,
        skip_special_tokens: bool | None = ...,
    ) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(
        self, dtype: str | None = ..., shape: _Iterable[int] | None = ..., data: bytes | None = ...
    ) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "token_id", "top_logprobs", "top_token_ids")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(
        self,
        token_id: int | None = ...,
        logprob: float | None = ...,
        top_token_ids: _Iterable[int] | None = ...,
        top_logprobs: _Iterable[float] | None = ...,
    ) -> None: ...

class Delta(_message.Message):
    __slots__ = (
        "error",
        "finish_reason",
        "has_logprobs",
        "logprobs",
        "num_cached_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "request_id",
        "stop_reason",
        "text",
        "token_ids",
    )
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    has_logprobs: bool
    finish_reason: str
    stop_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str
    def __init__(
        self,
        request_id: str | None = ...,
        token_ids: _Iterable[int] | None = ...,
        text: str | None = ...,
        logprobs: _Iterable[TokenLogprob | _Mapping] | None = ...,
        has_logprobs: bool | None = ...,
        finish_reason: str | None = ...,
        stop_reason: str | None = ...,
        num_prompt_tokens: int | None = ...,
        num_output_tokens: int | None = ...,
        num_cached_tokens: int | None = ...,
        error: str | None = ...,
    ) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("need_send", "prompt_embeds", "prompt_token_ids", "sampling", "transfer_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NEED_SEND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    need_send: int
    prompt_embeds: Tensor
    def __init__(
        self,
        transfer_id: str | None = ...,
        prompt_token_ids: _Iterable[int] | None = ...,
        sampling: Sampling | _Mapping | None = ...,
        need_send: int | None = ...,
        prompt_embeds: Tensor | _Mapping | None = ...,
    ) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("epoch", "first", "kv_held")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    KV_HELD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    first: Delta
    kv_held: bool
    epoch: str
    def __init__(
        self, first: Delta | _Mapping | None = ..., kv_held: bool | None = ..., epoch: str | None = ...
    ) -> None: ...

class Region(_message.Message):
    __slots__ = ("base_addr", "block_bytes", "block_stride_bytes", "layer_name", "num_blocks", "occurrence")
    LAYER_NAME_FIELD_NUMBER: _ClassVar[int]
    OCCURRENCE_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layer_name: str
    occurrence: int
    base_addr: int
    block_stride_bytes: int
    block_bytes: int
    num_blocks: int
    def __init__(
        self,
        layer_name: str | None = ...,
        occurrence: int | None = ...,
        base_addr: int | None = ...,
        block_stride_bytes: int | None = ...,
        block_bytes: int | None = ...,
        num_blocks: int | None = ...,
    ) -> None: ...

class HandshakeInfo(_message.Message):
    __slots__ = (
        "block_size",
        "compat_hash",
        "dtype",
        "epoch",
        "head_dim",
        "layer_names",
        "layout_version",
        "model_id",
        "num_kv_heads",
    )
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_NAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    block_size: int
    layer_names: _containers.RepeatedScalarFieldContainer[str]
    num_kv_heads: int
    head_dim: int
    layout_version: int
    epoch: str
    compat_hash: str
    def __init__(
        self,
        model_id: str | None = ...,
        dtype: str | None = ...,
        block_size: int | None = ...,
        layer_names: _Iterable[str] | None = ...,
        num_kv_heads: int | None = ...,
        head_dim: int | None = ...,
        layout_version: int | None = ...,
        epoch: str | None = ...,
        compat_hash: str | None = ...,
    ) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: HandshakeInfo
    def __init__(self, info: HandshakeInfo | _Mapping | None = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: HandshakeInfo
    def __init__(self, info: HandshakeInfo | _Mapping | None = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = (
        "dst_block_ids",
        "dst_compat_hash",
        "dst_regions",
        "dst_session",
        "expected_src_epoch",
        "num_tokens",
        "transfer_id",
    )
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DST_REGIONS_FIELD_NUMBER: _ClassVar[int]
    DST_SESSION_FIELD_NUMBER: _ClassVar[int]
    DST_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SRC_EPOCH_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    dst_regions: _containers.RepeatedCompositeFieldContainer[Region]
    dst_session: str
    dst_compat_hash: str
    expected_src_epoch: str
    def __init__(
        self,
        transfer_id: str | None = ...,
        dst_block_ids: _Iterable[int] | None = ...,
        num_tokens: int | None = ...,
        dst_regions: _Iterable[Region | _Mapping] | None = ...,
        dst_session: str | None = ...,
        dst_compat_hash: str | None = ...,
        expected_src_epoch: str | None = ...,
    ) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("bytes", "failed", "num_descriptors", "ok", "seconds")
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ok: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    num_descriptors: int
    seconds: float
    def __init__(
        self,
        ok: _Iterable[str] | None = ...,
        failed: _Iterable[str] | None = ...,
        bytes: int | None = ...,
        num_descriptors: int | None = ...,
        seconds: float | None = ...,
    ) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = (
        "output_token_ids",
        "prefill_address",
        "prompt_embeds",
        "prompt_token_ids",
        "remote_prefill",
        "request_id",
        "sampling",
        "transfer_id",
    )
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_prefill: bool
    transfer_id: str
    prefill_address: str
    prompt_embeds: Tensor
    def __init__(
        self,
        request_id: str | None = ...,
        prompt_token_ids: _Iterable[int] | None = ...,
        sampling: Sampling | _Mapping | None = ...,
        output_token_ids: _Iterable[int] | None = ...,
        remote_prefill: bool | None = ...,
        transfer_id: str | None = ...,
        prefill_address: str | None = ...,
        prompt_embeds: Tensor | _Mapping | None = ...,
    ) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids", "transfer_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self, request_ids: _Iterable[str] | None = ..., transfer_ids: _Iterable[str] | None = ...
    ) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: int | None = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = (
        "block_size",
        "epoch",
        "node",
        "num_aborted_total",
        "num_blocks_held_for_transfer",
        "num_blocks_total",
        "num_blocks_used",
        "num_held_requests",
        "num_running",
        "num_waiting",
        "role",
        "stranded_kv_blocks",
    )
    NODE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_HELD_FOR_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STRANDED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    node: str
    role: str
    epoch: str
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_held_for_transfer: int
    num_held_requests: int
    stranded_kv_blocks: int
    num_aborted_total: int
    block_size: int
    def __init__(
        self,
        node: str | None = ...,
        role: str | None = ...,
        epoch: str | None = ...,
        num_running: int | None = ...,
        num_waiting: int | None = ...,
        num_blocks_total: int | None = ...,
        num_blocks_used: int | None = ...,
        num_blocks_held_for_transfer: int | None = ...,
        num_held_requests: int | None = ...,
        stranded_kv_blocks: int | None = ...,
        num_aborted_total: int | None = ...,
        block_size: int | None = ...,
    ) -> None: ...

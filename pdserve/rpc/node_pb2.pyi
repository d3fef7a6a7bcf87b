from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "include_stop_str_in_output", "skip_special_tokens", "structured_kind", "structured_spec", "prompt_logprobs", "skip_detokenize")
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
    STRUCTURED_KIND_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_SPEC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
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
    structured_kind: str
    structured_spec: str
    prompt_logprobs: int
    skip_detokenize: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., structured_kind: _Optional[str] = ..., structured_spec: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., skip_detokenize: _Optional[bool] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "has_logprobs", "finish_reason", "stop_reason", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "error", "stop_token_id", "prompt_logprobs")
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
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
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
    stop_token_id: int
    prompt_logprobs: PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., has_logprobs: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("transfer_id", "prompt_token_ids", "sampling", "need_send", "prompt_embeds", "mm_items", "lora_name", "lora_ident")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NEED_SEND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_IDENT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    need_send: int
    prompt_embeds: Tensor
    mm_items: _containers.RepeatedCompositeFieldContainer[MmItem]
    lora_name: str
    lora_ident: str
    def __init__(self, transfer_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., need_send: _Optional[int] = ..., prompt_embeds: _Optional[_Union[Tensor, _Mapping]] = ..., mm_items: _Optional[_Iterable[_Union[MmItem, _Mapping]]] = ..., lora_name: _Optional[str] = ..., lora_ident: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first", "kv_held", "epoch", "lora_ident")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    KV_HELD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LORA_IDENT_FIELD_NUMBER: _ClassVar[int]
    first: Delta
    kv_held: bool
    epoch: str
    lora_ident: str
    def __init__(self, first: _Optional[_Union[Delta, _Mapping]] = ..., kv_held: _Optional[bool] = ..., epoch: _Optional[str] = ..., lora_ident: _Optional[str] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("layer_name", "occurrence", "base_addr", "block_stride_bytes", "block_bytes", "num_blocks")
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
    def __init__(self, layer_name: _Optional[str] = ..., occurrence: _Optional[int] = ..., base_addr: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class HandshakeInfo(_message.Message):
    __slots__ = ("model_id", "dtype", "block_size", "layer_names", "num_kv_heads", "head_dim", "layout_version", "epoch", "compat_hash", "kv_transport", "speculative", "stages", "kv_groups")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_NAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    block_size: int
    layer_names: _containers.RepeatedScalarFieldContainer[str]
    num_kv_heads: int
    head_dim: int
    layout_version: int
    epoch: str
    compat_hash: str
    kv_transport: str
    speculative: str
    stages: _containers.RepeatedCompositeFieldContainer[StageInfo]
    kv_groups: str
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., layer_names: _Optional[_Iterable[str]] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout_version: _Optional[int] = ..., epoch: _Optional[str] = ..., compat_hash: _Optional[str] = ..., kv_transport: _Optional[str] = ..., speculative: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageInfo, _Mapping]]] = ..., kv_groups: _Optional[str] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("pp_rank", "tp_rank", "pp_size", "layer_start", "layer_end", "session", "tp_size")
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    pp_rank: int
    tp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int
    session: str
    tp_size: int
    def __init__(self, pp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., session: _Optional[str] = ..., tp_size: _Optional[int] = ...) -> None: ...

class StageLoad(_message.Message):
    __slots__ = ("stage", "blocks_used", "blocks_held_for_transfer", "stranded_kv_blocks", "transfer_bytes", "transfer_failures", "transfers")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HELD_FOR_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    STRANDED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    stage: StageInfo
    blocks_used: int
    blocks_held_for_transfer: int
    stranded_kv_blocks: int
    transfer_bytes: int
    transfer_failures: int
    transfers: int
    def __init__(self, stage: _Optional[_Union[StageInfo, _Mapping]] = ..., blocks_used: _Optional[int] = ..., blocks_held_for_transfer: _Optional[int] = ..., stranded_kv_blocks: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_failures: _Optional[int] = ..., transfers: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: HandshakeInfo
    def __init__(self, info: _Optional[_Union[HandshakeInfo, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: HandshakeInfo
    def __init__(self, info: _Optional[_Union[HandshakeInfo, _Mapping]] = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = ("transfer_id", "dst_block_ids", "num_tokens", "dst_regions", "dst_session", "dst_compat_hash", "expected_src_epoch", "want_checksum", "dst_pp_rank", "dst_tp_rank", "dst_pp_size", "dst_layer_start", "dst_layer_end", "dst_tp_size", "early", "dst_group_block_ids")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DST_REGIONS_FIELD_NUMBER: _ClassVar[int]
    DST_SESSION_FIELD_NUMBER: _ClassVar[int]
    DST_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SRC_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WANT_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DST_PP_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DST_LAYER_START_FIELD_NUMBER: _ClassVar[int]
    DST_LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DST_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EARLY_FIELD_NUMBER: _ClassVar[int]
    DST_GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    dst_regions: _containers.RepeatedCompositeFieldContainer[Region]
    dst_session: str
    dst_compat_hash: str
    expected_src_epoch: str
    want_checksum: bool
    dst_pp_rank: int
    dst_tp_rank: int
    dst_pp_size: int
    dst_layer_start: int
    dst_layer_end: int
    dst_tp_size: int
    early: bool
    dst_group_block_ids: _containers.RepeatedCompositeFieldContainer[GroupBlockIds]
    def __init__(self, transfer_id: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., dst_regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., dst_session: _Optional[str] = ..., dst_compat_hash: _Optional[str] = ..., expected_src_epoch: _Optional[str] = ..., want_checksum: _Optional[bool] = ..., dst_pp_rank: _Optional[int] = ..., dst_tp_rank: _Optional[int] = ..., dst_pp_size: _Optional[int] = ..., dst_layer_start: _Optional[int] = ..., dst_layer_end: _Optional[int] = ..., dst_tp_size: _Optional[int] = ..., early: _Optional[bool] = ..., dst_group_block_ids: _Optional[_Iterable[_Union[GroupBlockIds, _Mapping]]] = ...) -> None: ...

class GroupBlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("ok", "failed", "bytes", "num_descriptors", "seconds", "stages", "checksum", "first_token_ids")
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ok: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    num_descriptors: int
    seconds: float
    stages: _containers.RepeatedCompositeFieldContainer[StageLoad]
    checksum: str
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ok: _Optional[_Iterable[str]] = ..., failed: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ..., seconds: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageLoad, _Mapping]]] = ..., checksum: _Optional[str] = ..., first_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "output_token_ids", "remote_prefill", "transfer_id", "prefill_address", "prompt_embeds", "prefill_epoch", "mm_items", "flush_interval_ms", "first_token_from_prefill", "lora_name", "lora_ident", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FROM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_IDENT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_prefill: bool
    transfer_id: str
    prefill_address: str
    prompt_embeds: Tensor
    prefill_epoch: str
    mm_items: _containers.RepeatedCompositeFieldContainer[MmItem]
    flush_interval_ms: int
    first_token_from_prefill: bool
    lora_name: str
    lora_ident: str
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., remote_prefill: _Optional[bool] = ..., transfer_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., prompt_embeds: _Optional[_Union[Tensor, _Mapping]] = ..., prefill_epoch: _Optional[str] = ..., mm_items: _Optional[_Iterable[_Union[MmItem, _Mapping]]] = ..., flush_interval_ms: _Optional[int] = ..., first_token_from_prefill: _Optional[bool] = ..., lora_name: _Optional[str] = ..., lora_ident: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class LoRALoadRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoRAUnloadRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoRAAdapterInfo(_message.Message):
    __slots__ = ("lora_name", "ident", "path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    IDENT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    ident: str
    path: str
    def __init__(self, lora_name: _Optional[str] = ..., ident: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoRAResponse(_message.Message):
    __slots__ = ("adapters", "newly_loaded")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEWLY_LOADED_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapterInfo]
    newly_loaded: bool
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoRAAdapterInfo, _Mapping]]] = ..., newly_loaded: _Optional[bool] = ...) -> None: ...

class MmItem(_message.Message):
    __slots__ = ("offset", "length", "key", "embeds", "encoder_address", "image")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    key: str
    embeds: Tensor
    encoder_address: str
    image: bytes
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., key: _Optional[str] = ..., embeds: _Optional[_Union[Tensor, _Mapping]] = ..., encoder_address: _Optional[str] = ..., image: _Optional[bytes] = ...) -> None: ...

class EncodeImage(_message.Message):
    __slots__ = ("data", "uuid")
    DATA_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    uuid: str
    def __init__(self, data: _Optional[bytes] = ..., uuid: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[EncodeImage]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[EncodeImage, _Mapping]]] = ...) -> None: ...

class EncodeItem(_message.Message):
    __slots__ = ("key", "length", "cache_hit")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    key: str
    length: int
    cache_hit: bool
    def __init__(self, key: _Optional[str] = ..., length: _Optional[int] = ..., cache_hit: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items", "node", "address")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    node: str
    address: str
    def __init__(self, items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ..., node: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class EncoderPushRequest(_message.Message):
    __slots__ = ("key", "dst_session", "dst_addr", "nbytes", "transfer_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DST_SESSION_FIELD_NUMBER: _ClassVar[int]
    DST_ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    dst_session: str
    dst_addr: int
    nbytes: int
    transfer_id: str
    def __init__(self, key: _Optional[str] = ..., dst_session: _Optional[str] = ..., dst_addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class EncoderPushResponse(_message.Message):
    __slots__ = ("bytes", "seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class EncoderLoadReport(_message.Message):
    __slots__ = ("node", "epoch", "num_cached", "buffer_bytes_used", "buffer_bytes_total", "num_in_flight")
    NODE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    node: str
    epoch: str
    num_cached: int
    buffer_bytes_used: int
    buffer_bytes_total: int
    num_in_flight: int
    def __init__(self, node: _Optional[str] = ..., epoch: _Optional[str] = ..., num_cached: _Optional[int] = ..., buffer_bytes_used: _Optional[int] = ..., buffer_bytes_total: _Optional[int] = ..., num_in_flight: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids", "transfer_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., transfer_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("node", "role", "epoch", "num_running", "num_waiting", "num_blocks_total", "num_blocks_used", "num_blocks_held_for_transfer", "num_held_requests", "stranded_kv_blocks", "num_aborted_total", "block_size", "num_pushes_in_flight", "num_pulls_in_flight", "prefix_cache_queried_blocks", "prefix_cache_hit_blocks", "lora_idents", "stages", "num_ec_reservations", "steps_socket")
    class LoraIdentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
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
    NUM_PUSHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_IDENTS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_EC_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_SOCKET_FIELD_NUMBER: _ClassVar[int]
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
    num_pushes_in_flight: int
    num_pulls_in_flight: int
    prefix_cache_queried_blocks: int
    prefix_cache_hit_blocks: int
    lora_idents: _containers.ScalarMap[str, str]
    stages: _containers.RepeatedCompositeFieldContainer[StageLoad]
    num_ec_reservations: int
    steps_socket: str
    def __init__(self, node: _Optional[str] = ..., role: _Optional[str] = ..., epoch: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_held_for_transfer: _Optional[int] = ..., num_held_requests: _Optional[int] = ..., stranded_kv_blocks: _Optional[int] = ..., num_aborted_total: _Optional[int] = ..., block_size: _Optional[int] = ..., num_pushes_in_flight: _Optional[int] = ..., num_pulls_in_flight: _Optional[int] = ..., prefix_cache_queried_blocks: _Optional[int] = ..., prefix_cache_hit_blocks: _Optional[int] = ..., lora_idents: _Optional[_Mapping[str, str]] = ..., stages: _Optional[_Iterable[_Union[StageLoad, _Mapping]]] = ..., num_ec_reservations: _Optional[int] = ..., steps_socket: _Optional[str] = ...) -> None: ...

class StepsHello(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class StepsWelcome(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("transfer_ids",)
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfer_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("unknown_transfer_ids", "epoch")
    UNKNOWN_TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    unknown_transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    epoch: str
    def __init__(self, unknown_transfer_ids: _Optional[_Iterable[str]] = ..., epoch: _Optional[str] = ...) -> None: ...

class StepCommand(_message.Message):
    __slots__ = ("start", "abort")
    START_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedCompositeFieldContainer[DecodeRequest]
    abort: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, start: _Optional[_Iterable[_Union[DecodeRequest, _Mapping]]] = ..., abort: _Optional[_Iterable[str]] = ...) -> None: ...

class StepEnd(_message.Message):
    __slots__ = ("request_id", "code", "details", "kv_load_failed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_FAILED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    details: str
    kv_load_failed: bool
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., kv_load_failed: _Optional[bool] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("deltas", "ends", "stream_end")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_END_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[Delta]
    ends: _containers.RepeatedCompositeFieldContainer[StepEnd]
    stream_end: StepEnd
    def __init__(self, deltas: _Optional[_Iterable[_Union[Delta, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[StepEnd, _Mapping]]] = ..., stream_end: _Optional[_Union[StepEnd, _Mapping]] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]

class StateDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_DTYPE_FLOAT32: _ClassVar[StateDtype]
    STATE_DTYPE_BFLOAT16: _ClassVar[StateDtype]
    STATE_DTYPE_BLOCKWISE8: _ClassVar[StateDtype]

class Residency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_UNSPECIFIED: _ClassVar[Residency]
    RESIDENCY_RAM: _ClassVar[Residency]
    RESIDENCY_NVME: _ClassVar[Residency]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
STATE_DTYPE_FLOAT32: StateDtype
STATE_DTYPE_BFLOAT16: StateDtype
STATE_DTYPE_BLOCKWISE8: StateDtype
RESIDENCY_UNSPECIFIED: Residency
RESIDENCY_RAM: Residency
RESIDENCY_NVME: Residency

class ShardKey(_message.Message):
    __slots__ = ("run_id", "shard_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    shard_id: int
    def __init__(self, run_id: _Optional[str] = ..., shard_id: _Optional[int] = ...) -> None: ...

class AdamWHyperParams(_message.Message):
    __slots__ = ("beta1", "beta2", "eps", "weight_decay", "max_grad_norm")
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float
    def __init__(self, beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class Fragment(_message.Message):
    __slots__ = ("offset", "length", "group")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    group: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., group: _Optional[int] = ...) -> None: ...

class UpdateGroup(_message.Message):
    __slots__ = ("weight_decay", "lr_scale")
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    weight_decay: float
    lr_scale: float
    def __init__(self, weight_decay: _Optional[float] = ..., lr_scale: _Optional[float] = ...) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("key", "start", "numel", "fragments", "grad_dtype", "hyper", "groups", "state_dtype")
    KEY_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    start: int
    numel: int
    fragments: _containers.RepeatedCompositeFieldContainer[Fragment]
    grad_dtype: DType
    hyper: AdamWHyperParams
    groups: _containers.RepeatedCompositeFieldContainer[UpdateGroup]
    state_dtype: StateDtype
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., start: _Optional[int] = ..., numel: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[Fragment, _Mapping]]] = ..., grad_dtype: _Optional[_Union[DType, str]] = ..., hyper: _Optional[_Union[AdamWHyperParams, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[UpdateGroup, _Mapping]]] = ..., state_dtype: _Optional[_Union[StateDtype, str]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("byte_offset", "data", "crc32c")
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    byte_offset: int
    data: bytes
    crc32c: int
    def __init__(self, byte_offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class RegisterShardRequest(_message.Message):
    __slots__ = ("spec", "initial_weights")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    spec: ShardSpec
    initial_weights: TensorChunk
    def __init__(self, spec: _Optional[_Union[ShardSpec, _Mapping]] = ..., initial_weights: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class RegisterShardResponse(_message.Message):
    __slots__ = ("step", "created")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    step: int
    created: bool
    def __init__(self, step: _Optional[int] = ..., created: _Optional[bool] = ...) -> None: ...

class DescribeShardRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ...) -> None: ...

class DescribeShardResponse(_message.Message):
    __slots__ = ("spec", "step")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    spec: ShardSpec
    step: int
    def __init__(self, spec: _Optional[_Union[ShardSpec, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("path", "byte_offset")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    path: str
    byte_offset: int
    def __init__(self, path: _Optional[str] = ..., byte_offset: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("key", "step", "dtype", "numel", "global_grad_norm", "lr", "defer_update", "shm", "prepare_dtype", "weights_out")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    DEFER_UPDATE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    PREPARE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_OUT_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    step: int
    dtype: DType
    numel: int
    global_grad_norm: float
    lr: float
    defer_update: bool
    shm: SharedMemoryRef
    prepare_dtype: DType
    weights_out: SharedMemoryRef
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., step: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., numel: _Optional[int] = ..., global_grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., defer_update: _Optional[bool] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., prepare_dtype: _Optional[_Union[DType, str]] = ..., weights_out: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class PushGradientRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PushGradientResponse(_message.Message):
    __slots__ = ("step", "applied", "update_seconds", "weights_written")
    STEP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    step: int
    applied: bool
    update_seconds: float
    weights_written: bool
    def __init__(self, step: _Optional[int] = ..., applied: _Optional[bool] = ..., update_seconds: _Optional[float] = ..., weights_written: _Optional[bool] = ...) -> None: ...

class CommitStepRequest(_message.Message):
    __slots__ = ("key", "step", "global_grad_norm", "lr", "prepare_dtype", "loss_scale", "weights_out")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    PREPARE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_OUT_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    step: int
    global_grad_norm: float
    lr: float
    prepare_dtype: DType
    loss_scale: float
    weights_out: SharedMemoryRef
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., step: _Optional[int] = ..., global_grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., prepare_dtype: _Optional[_Union[DType, str]] = ..., loss_scale: _Optional[float] = ..., weights_out: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("key", "step", "dtype", "chunk_bytes", "shm")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    step: int
    dtype: DType
    chunk_bytes: int
    shm: SharedMemoryRef
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., step: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., chunk_bytes: _Optional[int] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("step", "dtype", "numel", "chunk")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    step: int
    dtype: DType
    numel: int
    chunk: TensorChunk
    def __init__(self, step: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., numel: _Optional[int] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class OpenBulkRequest(_message.Message):
    __slots__ = ("push", "fetch", "chunk_bytes")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    push: PushHeader
    fetch: FetchWeightsRequest
    chunk_bytes: int
    def __init__(self, push: _Optional[_Union[PushHeader, _Mapping]] = ..., fetch: _Optional[_Union[FetchWeightsRequest, _Mapping]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class OpenBulkResponse(_message.Message):
    __slots__ = ("ticket", "port", "nbytes", "chunk_bytes")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    port: int
    nbytes: int
    chunk_bytes: int
    def __init__(self, ticket: _Optional[bytes] = ..., port: _Optional[int] = ..., nbytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ShardStats(_message.Message):
    __slots__ = ("key", "step", "numel", "resident_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    step: int
    numel: int
    resident_bytes: int
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., step: _Optional[int] = ..., numel: _Optional[int] = ..., resident_bytes: _Optional[int] = ...) -> None: ...

class PartitionPlan(_message.Message):
    __slots__ = ("key", "index", "offset", "numel", "planned", "actual", "order", "step", "path")
    KEY_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    index: int
    offset: int
    numel: int
    planned: Residency
    actual: Residency
    order: int
    step: int
    path: str
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., planned: _Optional[_Union[Residency, str]] = ..., actual: _Optional[_Union[Residency, str]] = ..., order: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class TierPath(_message.Message):
    __slots__ = ("path", "direct_io", "read_bytes_per_s", "write_bytes_per_s")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    path: str
    direct_io: bool
    read_bytes_per_s: float
    write_bytes_per_s: float
    def __init__(self, path: _Optional[str] = ..., direct_io: _Optional[bool] = ..., read_bytes_per_s: _Optional[float] = ..., write_bytes_per_s: _Optional[float] = ...) -> None: ...

class TierPlanSummary(_message.Message):
    __slots__ = ("enabled", "ram_budget_bytes", "staging_bytes", "buffer_count", "ram_used_bytes", "planned_ram_bytes", "planned_nvme_bytes", "predicted_io_seconds", "paths")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    RAM_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_COUNT_FIELD_NUMBER: _ClassVar[int]
    RAM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLANNED_RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLANNED_NVME_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_IO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    ram_budget_bytes: int
    staging_bytes: int
    buffer_count: int
    ram_used_bytes: int
    planned_ram_bytes: int
    planned_nvme_bytes: int
    predicted_io_seconds: float
    paths: _containers.RepeatedCompositeFieldContainer[TierPath]
    def __init__(self, enabled: _Optional[bool] = ..., ram_budget_bytes: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., buffer_count: _Optional[int] = ..., ram_used_bytes: _Optional[int] = ..., planned_ram_bytes: _Optional[int] = ..., planned_nvme_bytes: _Optional[int] = ..., predicted_io_seconds: _Optional[float] = ..., paths: _Optional[_Iterable[_Union[TierPath, _Mapping]]] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("shards", "received_bytes", "sent_bytes", "updates_applied", "duplicate_pushes", "resident_bytes_by_tier", "metrics_address", "partitions", "tier")
    class ResidentBytesByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUSHES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardStats]
    received_bytes: int
    sent_bytes: int
    updates_applied: int
    duplicate_pushes: int
    resident_bytes_by_tier: _containers.ScalarMap[str, int]
    metrics_address: str
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionPlan]
    tier: TierPlanSummary
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardStats, _Mapping]]] = ..., received_bytes: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., updates_applied: _Optional[int] = ..., duplicate_pushes: _Optional[int] = ..., resident_bytes_by_tier: _Optional[_Mapping[str, int]] = ..., metrics_address: _Optional[str] = ..., partitions: _Optional[_Iterable[_Union[PartitionPlan, _Mapping]]] = ..., tier: _Optional[_Union[TierPlanSummary, _Mapping]] = ...) -> None: ...

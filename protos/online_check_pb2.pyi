from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTION_UNSPECIFIED: _ClassVar[Direction]
    FORWARD: _ClassVar[Direction]
    BACKWARD: _ClassVar[Direction]
DIRECTION_UNSPECIFIED: Direction
FORWARD: Direction
BACKWARD: Direction

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "stride", "offset", "nbytes", "requires_grad", "device")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    requires_grad: bool
    device: str
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., requires_grad: _Optional[bool] = ..., device: _Optional[str] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Mapping(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("start", "stop", "step")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    start: Value
    stop: Value
    step: Value
    def __init__(self, start: _Optional[_Union[Value, _Mapping]] = ..., stop: _Optional[_Union[Value, _Mapping]] = ..., step: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...

class Complex(_message.Message):
    __slots__ = ("real", "imag")
    REAL_FIELD_NUMBER: _ClassVar[int]
    IMAG_FIELD_NUMBER: _ClassVar[int]
    real: float
    imag: float
    def __init__(self, real: _Optional[float] = ..., imag: _Optional[float] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("none", "b", "i", "f", "s", "tensor", "tuple", "list", "dict", "dtype", "device", "slice", "ellipsis", "size", "c", "memory_format", "layout", "opaque", "named_tuple")
    NONE_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    F_FIELD_NUMBER: _ClassVar[int]
    S_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    ELLIPSIS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    C_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_FIELD_NUMBER: _ClassVar[int]
    NAMED_TUPLE_FIELD_NUMBER: _ClassVar[int]
    none: bool
    b: bool
    i: int
    f: float
    s: str
    tensor: int
    tuple: Sequence
    list: Sequence
    dict: Mapping
    dtype: str
    device: str
    slice: Slice
    ellipsis: bool
    size: Sequence
    c: Complex
    memory_format: str
    layout: str
    opaque: str
    named_tuple: Sequence
    def __init__(self, none: _Optional[bool] = ..., b: _Optional[bool] = ..., i: _Optional[int] = ..., f: _Optional[float] = ..., s: _Optional[str] = ..., tensor: _Optional[int] = ..., tuple: _Optional[_Union[Sequence, _Mapping]] = ..., list: _Optional[_Union[Sequence, _Mapping]] = ..., dict: _Optional[_Union[Mapping, _Mapping]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., slice: _Optional[_Union[Slice, _Mapping]] = ..., ellipsis: _Optional[bool] = ..., size: _Optional[_Union[Sequence, _Mapping]] = ..., c: _Optional[_Union[Complex, _Mapping]] = ..., memory_format: _Optional[str] = ..., layout: _Optional[str] = ..., opaque: _Optional[str] = ..., named_tuple: _Optional[_Union[Sequence, _Mapping]] = ...) -> None: ...

class Autocast(_message.Message):
    __slots__ = ("enabled", "dtype", "device_type")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    dtype: str
    device_type: str
    def __init__(self, enabled: _Optional[bool] = ..., dtype: _Optional[str] = ..., device_type: _Optional[str] = ...) -> None: ...

class Random(_message.Message):
    __slots__ = ("generator_state", "device_type", "mask", "has_mask")
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    HAS_MASK_FIELD_NUMBER: _ClassVar[int]
    generator_state: bytes
    device_type: str
    mask: int
    has_mask: bool
    def __init__(self, generator_state: _Optional[bytes] = ..., device_type: _Optional[str] = ..., mask: _Optional[int] = ..., has_mask: _Optional[bool] = ...) -> None: ...

class Collective(_message.Message):
    __slots__ = ("job", "group", "ranks", "seq", "op", "root", "async_op", "error", "unfinished")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    ASYNC_OP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UNFINISHED_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    op: str
    root: int
    async_op: bool
    error: str
    unfinished: bool
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ..., op: _Optional[str] = ..., root: _Optional[int] = ..., async_op: _Optional[bool] = ..., error: _Optional[str] = ..., unfinished: _Optional[bool] = ...) -> None: ...

class RecordHeader(_message.Message):
    __slots__ = ("run_id", "rank", "step", "seq", "name", "direction", "module", "source")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    step: int
    seq: int
    name: str
    direction: Direction
    module: str
    source: str
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., seq: _Optional[int] = ..., name: _Optional[str] = ..., direction: _Optional[_Union[Direction, str]] = ..., module: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("header", "tensors", "payload_bytes", "args", "kwargs", "output", "grad_enabled", "autocast", "inplace", "random", "grad_output", "grad_input", "backward_expected", "skip_reason", "grad_input_positions", "intra_op_threads", "collective")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    GRAD_ENABLED_FIELD_NUMBER: _ClassVar[int]
    AUTOCAST_FIELD_NUMBER: _ClassVar[int]
    INPLACE_FIELD_NUMBER: _ClassVar[int]
    RANDOM_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    SKIP_REASON_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    INTRA_OP_THREADS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    header: RecordHeader
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    payload_bytes: int
    args: Sequence
    kwargs: Mapping
    output: Value
    grad_enabled: bool
    autocast: Autocast
    inplace: bool
    random: Random
    grad_output: Value
    grad_input: Value
    backward_expected: bool
    skip_reason: str
    grad_input_positions: _containers.RepeatedScalarFieldContainer[int]
    intra_op_threads: int
    collective: Collective
    def __init__(self, header: _Optional[_Union[RecordHeader, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., payload_bytes: _Optional[int] = ..., args: _Optional[_Union[Sequence, _Mapping]] = ..., kwargs: _Optional[_Union[Mapping, _Mapping]] = ..., output: _Optional[_Union[Value, _Mapping]] = ..., grad_enabled: _Optional[bool] = ..., autocast: _Optional[_Union[Autocast, _Mapping]] = ..., inplace: _Optional[bool] = ..., random: _Optional[_Union[Random, _Mapping]] = ..., grad_output: _Optional[_Union[Value, _Mapping]] = ..., grad_input: _Optional[_Union[Value, _Mapping]] = ..., backward_expected: _Optional[bool] = ..., skip_reason: _Optional[str] = ..., grad_input_positions: _Optional[_Iterable[int]] = ..., intra_op_threads: _Optional[int] = ..., collective: _Optional[_Union[Collective, _Mapping]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[Record]
    def __init__(self, records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("seq", "offset")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    seq: int
    offset: int
    def __init__(self, seq: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ("run_id", "rank", "captured", "sent", "acknowledged", "dropped", "last_seq", "world_size", "sampling", "job")
    class SamplingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    captured: int
    sent: int
    acknowledged: int
    dropped: int
    last_seq: int
    world_size: int
    sampling: _containers.ScalarMap[str, int]
    job: str
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., captured: _Optional[int] = ..., sent: _Optional[int] = ..., acknowledged: _Optional[int] = ..., dropped: _Optional[int] = ..., last_seq: _Optional[int] = ..., world_size: _Optional[int] = ..., sampling: _Optional[_Mapping[str, int]] = ..., job: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("run_id", "rank", "agent_version", "world_size", "asks")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ASKS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    agent_version: str
    world_size: int
    asks: bool
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., agent_version: _Optional[str] = ..., world_size: _Optional[int] = ..., asks: _Optional[bool] = ...) -> None: ...

class Ask(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Frame(_message.Message):
    __slots__ = ("record", "chunk", "end", "hello", "batch", "ask", "data")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ASK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    record: Record
    chunk: Chunk
    end: End
    hello: Hello
    batch: Batch
    ask: Ask
    data: bytes
    def __init__(self, record: _Optional[_Union[Record, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., ask: _Optional[_Union[Ask, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "status", "reason", "count")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[Ack.Status]
        ACCEPTED: _ClassVar[Ack.Status]
        DUPLICATE: _ClassVar[Ack.Status]
        REJECTED: _ClassVar[Ack.Status]
        END_ACCEPTED: _ClassVar[Ack.Status]
        ASKS_TAKEN: _ClassVar[Ack.Status]
    STATUS_UNSPECIFIED: Ack.Status
    ACCEPTED: Ack.Status
    DUPLICATE: Ack.Status
    REJECTED: Ack.Status
    END_ACCEPTED: Ack.Status
    ASKS_TAKEN: Ack.Status
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    status: Ack.Status
    reason: str
    count: int
    def __init__(self, seq: _Optional[int] = ..., status: _Optional[_Union[Ack.Status, str]] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAGE_STATE_UNSPECIFIED: _ClassVar[PageState]
    HOT: _ClassVar[PageState]
    COLD: _ClassVar[PageState]
    DROPPED: _ClassVar[PageState]
    CORRUPT: _ClassVar[PageState]
PAGE_STATE_UNSPECIFIED: PageState
HOT: PageState
COLD: PageState
DROPPED: PageState
CORRUPT: PageState

class SessionRef(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "model_id", "fingerprint", "budget_tokens", "closed", "created_unix", "updated_unix", "turn", "attention_tokens", "counters", "labels", "pages")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_id: str
    fingerprint: str
    budget_tokens: int
    closed: bool
    created_unix: float
    updated_unix: float
    turn: int
    attention_tokens: int
    counters: _containers.ScalarMap[str, int]
    labels: _containers.ScalarMap[str, str]
    pages: PageCounts
    def __init__(self, session_id: _Optional[str] = ..., model_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., budget_tokens: _Optional[int] = ..., closed: _Optional[bool] = ..., created_unix: _Optional[float] = ..., updated_unix: _Optional[float] = ..., turn: _Optional[int] = ..., attention_tokens: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., labels: _Optional[_Mapping[str, str]] = ..., pages: _Optional[_Union[PageCounts, _Mapping]] = ...) -> None: ...

class PageCounts(_message.Message):
    __slots__ = ("hot", "cold", "pinned", "dropped", "corrupt", "hot_tokens", "cold_tokens", "pinned_tokens", "bytes_on_disk")
    HOT_FIELD_NUMBER: _ClassVar[int]
    COLD_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    HOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COLD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    hot: int
    cold: int
    pinned: int
    dropped: int
    corrupt: int
    hot_tokens: int
    cold_tokens: int
    pinned_tokens: int
    bytes_on_disk: int
    def __init__(self, hot: _Optional[int] = ..., cold: _Optional[int] = ..., pinned: _Optional[int] = ..., dropped: _Optional[int] = ..., corrupt: _Optional[int] = ..., hot_tokens: _Optional[int] = ..., cold_tokens: _Optional[int] = ..., pinned_tokens: _Optional[int] = ..., bytes_on_disk: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "model_id", "fingerprint", "budget_tokens", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_id: str
    fingerprint: str
    budget_tokens: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., model_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., budget_tokens: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("include_closed",)
    INCLUDE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    include_closed: bool
    def __init__(self, include_closed: _Optional[bool] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("pages_deleted", "bytes_freed")
    PAGES_DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    pages_deleted: int
    bytes_freed: int
    def __init__(self, pages_deleted: _Optional[int] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class FindPrefixRequest(_message.Message):
    __slots__ = ("model_id", "fingerprint", "prefix_hashes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    fingerprint: str
    prefix_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., prefix_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class FindPrefixResponse(_message.Message):
    __slots__ = ("session_id", "pages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pages: int
    def __init__(self, session_id: _Optional[str] = ..., pages: _Optional[int] = ...) -> None: ...

class HoldSessionRequest(_message.Message):
    __slots__ = ("session_id", "model_id", "lease_s", "renew", "release")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_id: str
    lease_s: float
    renew: bool
    release: bool
    def __init__(self, session_id: _Optional[str] = ..., model_id: _Optional[str] = ..., lease_s: _Optional[float] = ..., renew: _Optional[bool] = ..., release: _Optional[bool] = ...) -> None: ...

class HoldSessionResponse(_message.Message):
    __slots__ = ("token", "adopted", "previous_node")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_NODE_FIELD_NUMBER: _ClassVar[int]
    token: int
    adopted: bool
    previous_node: str
    def __init__(self, token: _Optional[int] = ..., adopted: _Optional[bool] = ..., previous_node: _Optional[str] = ...) -> None: ...

class BranchSessionRequest(_message.Message):
    __slots__ = ("session_id", "parent_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    parent_id: str
    def __init__(self, session_id: _Optional[str] = ..., parent_id: _Optional[str] = ...) -> None: ...

class BranchSessionResponse(_message.Message):
    __slots__ = ("session", "pages", "shared_bytes")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    session: Session
    pages: int
    shared_bytes: int
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., pages: _Optional[int] = ..., shared_bytes: _Optional[int] = ...) -> None: ...

class Page(_message.Message):
    __slots__ = ("page_id", "index", "token_start", "token_end", "original_position", "state", "locator", "byte_size", "checksum", "dtype", "layer_view", "updated_unix", "last_used_turn", "score", "prefix_hash")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_POSITION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOCATOR_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_VIEW_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_TURN_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    page_id: str
    index: int
    token_start: int
    token_end: int
    original_position: int
    state: PageState
    locator: str
    byte_size: int
    checksum: str
    dtype: str
    layer_view: str
    updated_unix: float
    last_used_turn: int
    score: float
    prefix_hash: str
    def __init__(self, page_id: _Optional[str] = ..., index: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., original_position: _Optional[int] = ..., state: _Optional[_Union[PageState, str]] = ..., locator: _Optional[str] = ..., byte_size: _Optional[int] = ..., checksum: _Optional[str] = ..., dtype: _Optional[str] = ..., layer_view: _Optional[str] = ..., updated_unix: _Optional[float] = ..., last_used_turn: _Optional[int] = ..., score: _Optional[float] = ..., prefix_hash: _Optional[str] = ...) -> None: ...

class UpsertPagesRequest(_message.Message):
    __slots__ = ("session_id", "pages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pages: _containers.RepeatedCompositeFieldContainer[Page]
    def __init__(self, session_id: _Optional[str] = ..., pages: _Optional[_Iterable[_Union[Page, _Mapping]]] = ...) -> None: ...

class PageStateChange(_message.Message):
    __slots__ = ("page_id", "state", "last_used_turn", "score", "restored_checksum")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_TURN_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    RESTORED_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    page_id: str
    state: PageState
    last_used_turn: int
    score: float
    restored_checksum: str
    def __init__(self, page_id: _Optional[str] = ..., state: _Optional[_Union[PageState, str]] = ..., last_used_turn: _Optional[int] = ..., score: _Optional[float] = ..., restored_checksum: _Optional[str] = ...) -> None: ...

class SetPageStatesRequest(_message.Message):
    __slots__ = ("session_id", "changes", "leases")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    changes: _containers.RepeatedCompositeFieldContainer[PageStateChange]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, session_id: _Optional[str] = ..., changes: _Optional[_Iterable[_Union[PageStateChange, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class DeletePagesRequest(_message.Message):
    __slots__ = ("session_id", "page_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class QueryPagesRequest(_message.Message):
    __slots__ = ("session_id", "states", "start_after", "limit")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    states: _containers.RepeatedScalarFieldContainer[PageState]
    start_after: str
    limit: int
    def __init__(self, session_id: _Optional[str] = ..., states: _Optional[_Iterable[_Union[PageState, str]]] = ..., start_after: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class GetPagesRequest(_message.Message):
    __slots__ = ("session_id", "page_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class QueryPagesResponse(_message.Message):
    __slots__ = ("pages", "next_after")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[Page]
    next_after: str
    def __init__(self, pages: _Optional[_Iterable[_Union[Page, _Mapping]]] = ..., next_after: _Optional[str] = ...) -> None: ...

class PageRef(_message.Message):
    __slots__ = ("session_id", "page_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    page_id: str
    def __init__(self, session_id: _Optional[str] = ..., page_id: _Optional[str] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("session_id", "page_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    page_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., page_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReclaimRequest(_message.Message):
    __slots__ = ("bytes_needed",)
    BYTES_NEEDED_FIELD_NUMBER: _ClassVar[int]
    bytes_needed: int
    def __init__(self, bytes_needed: _Optional[int] = ...) -> None: ...

class ReclaimResponse(_message.Message):
    __slots__ = ("bytes_freed", "dropped", "free_bytes", "reserve_bytes")
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes_freed: int
    dropped: _containers.RepeatedCompositeFieldContainer[PageRef]
    free_bytes: int
    reserve_bytes: int
    def __init__(self, bytes_freed: _Optional[int] = ..., dropped: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ..., free_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ...) -> None: ...

class Pin(_message.Message):
    __slots__ = ("page_id", "kind")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    page_id: str
    kind: str
    def __init__(self, page_id: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class SetPinsRequest(_message.Message):
    __slots__ = ("session_id", "add", "remove")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    add: _containers.RepeatedCompositeFieldContainer[Pin]
    remove: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., add: _Optional[_Iterable[_Union[Pin, _Mapping]]] = ..., remove: _Optional[_Iterable[str]] = ...) -> None: ...

class QueryPinsResponse(_message.Message):
    __slots__ = ("pins",)
    PINS_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[Pin]
    def __init__(self, pins: _Optional[_Iterable[_Union[Pin, _Mapping]]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("page_id", "until_turn", "expires_unix")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    UNTIL_TURN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    page_id: str
    until_turn: int
    expires_unix: float
    def __init__(self, page_id: _Optional[str] = ..., until_turn: _Optional[int] = ..., expires_unix: _Optional[float] = ...) -> None: ...

class SetLeasesRequest(_message.Message):
    __slots__ = ("session_id", "add", "remove")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    add: _containers.RepeatedCompositeFieldContainer[Lease]
    remove: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., add: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., remove: _Optional[_Iterable[str]] = ...) -> None: ...

class QueryLeasesResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("slot", "token_count", "fingerprint", "locator", "byte_size", "checksum", "created_unix")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LOCATOR_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    slot: str
    token_count: int
    fingerprint: str
    locator: str
    byte_size: int
    checksum: str
    created_unix: float
    def __init__(self, slot: _Optional[str] = ..., token_count: _Optional[int] = ..., fingerprint: _Optional[str] = ..., locator: _Optional[str] = ..., byte_size: _Optional[int] = ..., checksum: _Optional[str] = ..., created_unix: _Optional[float] = ...) -> None: ...

class PutSnapshotRequest(_message.Message):
    __slots__ = ("session_id", "snapshot")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    snapshot: Snapshot
    def __init__(self, session_id: _Optional[str] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ...) -> None: ...

class QuerySnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[Snapshot]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[Snapshot, _Mapping]]] = ...) -> None: ...

class TranscriptSegment(_message.Message):
    __slots__ = ("text", "token_ids", "generated", "opener")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    OPENER_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated: bool
    opener: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., generated: _Optional[bool] = ..., opener: _Optional[bool] = ...) -> None: ...

class SessionRecord(_message.Message):
    __slots__ = ("turn", "attention_tokens", "fingerprint", "fingerprint_parts", "message_hashes", "ledger_pages", "counters", "segments", "tokens", "resident_pages", "resident_positions")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TURN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_PARTS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEDGER_PAGES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    turn: int
    attention_tokens: int
    fingerprint: str
    fingerprint_parts: _containers.RepeatedScalarFieldContainer[str]
    message_hashes: _containers.RepeatedScalarFieldContainer[str]
    ledger_pages: _containers.RepeatedScalarFieldContainer[int]
    counters: _containers.ScalarMap[str, int]
    segments: int
    tokens: int
    resident_pages: _containers.RepeatedScalarFieldContainer[int]
    resident_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, turn: _Optional[int] = ..., attention_tokens: _Optional[int] = ..., fingerprint: _Optional[str] = ..., fingerprint_parts: _Optional[_Iterable[str]] = ..., message_hashes: _Optional[_Iterable[str]] = ..., ledger_pages: _Optional[_Iterable[int]] = ..., counters: _Optional[_Mapping[str, int]] = ..., segments: _Optional[int] = ..., tokens: _Optional[int] = ..., resident_pages: _Optional[_Iterable[int]] = ..., resident_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class WriteRecordRequest(_message.Message):
    __slots__ = ("session_id", "record", "keep_segments", "append", "snapshots")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    KEEP_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    record: SessionRecord
    keep_segments: int
    append: _containers.RepeatedCompositeFieldContainer[TranscriptSegment]
    snapshots: _containers.RepeatedCompositeFieldContainer[Snapshot]
    def __init__(self, session_id: _Optional[str] = ..., record: _Optional[_Union[SessionRecord, _Mapping]] = ..., keep_segments: _Optional[int] = ..., append: _Optional[_Iterable[_Union[TranscriptSegment, _Mapping]]] = ..., snapshots: _Optional[_Iterable[_Union[Snapshot, _Mapping]]] = ...) -> None: ...

class RecordReply(_message.Message):
    __slots__ = ("record", "segments")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    record: SessionRecord
    segments: _containers.RepeatedCompositeFieldContainer[TranscriptSegment]
    def __init__(self, record: _Optional[_Union[SessionRecord, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[TranscriptSegment, _Mapping]]] = ...) -> None: ...

class WriteAck(_message.Message):
    __slots__ = ("commit_seq", "applied", "commit_ms")
    COMMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    COMMIT_MS_FIELD_NUMBER: _ClassVar[int]
    commit_seq: int
    applied: int
    commit_ms: float
    def __init__(self, commit_seq: _Optional[int] = ..., applied: _Optional[int] = ..., commit_ms: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("session_id", "include_closed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    include_closed: bool
    def __init__(self, session_id: _Optional[str] = ..., include_closed: _Optional[bool] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("commit_seq", "last_commit_ms", "store_bytes", "free_bytes", "reserve_bytes", "quota_bytes", "sync_mode", "root", "pid", "uptime_s", "sessions", "schema_version", "session_quota_bytes", "max_idle_s", "object_store", "cached_bytes", "cache_limit_bytes", "objects_uploaded", "objects_fetched", "bytes_uploaded", "bytes_fetched", "node")
    COMMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    OBJECT_STORE_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_UPLOADED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_UPLOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    commit_seq: int
    last_commit_ms: float
    store_bytes: int
    free_bytes: int
    reserve_bytes: int
    quota_bytes: int
    sync_mode: str
    root: str
    pid: int
    uptime_s: float
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStatus]
    schema_version: int
    session_quota_bytes: int
    max_idle_s: float
    object_store: str
    cached_bytes: int
    cache_limit_bytes: int
    objects_uploaded: int
    objects_fetched: int
    bytes_uploaded: int
    bytes_fetched: int
    node: str
    def __init__(self, commit_seq: _Optional[int] = ..., last_commit_ms: _Optional[float] = ..., store_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., sync_mode: _Optional[str] = ..., root: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., sessions: _Optional[_Iterable[_Union[SessionStatus, _Mapping]]] = ..., schema_version: _Optional[int] = ..., session_quota_bytes: _Optional[int] = ..., max_idle_s: _Optional[float] = ..., object_store: _Optional[str] = ..., cached_bytes: _Optional[int] = ..., cache_limit_bytes: _Optional[int] = ..., objects_uploaded: _Optional[int] = ..., objects_fetched: _Optional[int] = ..., bytes_uploaded: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("session_id", "model_id", "budget_tokens", "attention_tokens", "turn", "pages", "snapshots", "closed", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_id: str
    budget_tokens: int
    attention_tokens: int
    turn: int
    pages: PageCounts
    snapshots: int
    closed: bool
    counters: _containers.ScalarMap[str, int]
    def __init__(self, session_id: _Optional[str] = ..., model_id: _Optional[str] = ..., budget_tokens: _Optional[int] = ..., attention_tokens: _Optional[int] = ..., turn: _Optional[int] = ..., pages: _Optional[_Union[PageCounts, _Mapping]] = ..., snapshots: _Optional[int] = ..., closed: _Optional[bool] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GcRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class GcReply(_message.Message):
    __slots__ = ("orphan_files_removed", "temp_files_removed", "leases_expired", "bytes_freed", "idle_sessions_deleted", "orphan_objects_removed", "object_bytes_freed")
    ORPHAN_FILES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    TEMP_FILES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    IDLE_SESSIONS_DELETED_FIELD_NUMBER: _ClassVar[int]
    ORPHAN_OBJECTS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    OBJECT_BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    orphan_files_removed: int
    temp_files_removed: int
    leases_expired: int
    bytes_freed: int
    idle_sessions_deleted: int
    orphan_objects_removed: int
    object_bytes_freed: int
    def __init__(self, orphan_files_removed: _Optional[int] = ..., temp_files_removed: _Optional[int] = ..., leases_expired: _Optional[int] = ..., bytes_freed: _Optional[int] = ..., idle_sessions_deleted: _Optional[int] = ..., orphan_objects_removed: _Optional[int] = ..., object_bytes_freed: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("pages_checked", "pages_ok", "corrupt", "snapshots_checked", "bytes_read")
    PAGES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    PAGES_OK_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    pages_checked: int
    pages_ok: int
    corrupt: _containers.RepeatedCompositeFieldContainer[PageRef]
    snapshots_checked: int
    bytes_read: int
    def __init__(self, pages_checked: _Optional[int] = ..., pages_ok: _Optional[int] = ..., corrupt: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ..., snapshots_checked: _Optional[int] = ..., bytes_read: _Optional[int] = ...) -> None: ...

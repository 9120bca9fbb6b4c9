"""Mapping between the SDK's topic messages and the port's, on real SDK objects."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import cast

import pytest
import zstandard
from ydb import TopicReaderAsyncIO, TopicReaderBatch, TopicReaderMessage
from ydb._grpc.grpcwrapper.ydb_topic import Codec, OffsetsRange
from ydb._topic_reader.datatypes import PartitionSession as SdkPartitionSession
from ydb._topic_writer.topic_writer import InternalMessage

from nemesis.broker.port import OutgoingMessage, PartitionSession
from nemesis.broker.ydb.mapping import (
    KEY_ITEM,
    Undecodable,
    YdbSession,
    sdk_partition_sessions,
    sdk_session,
    session_key,
    to_message,
    to_sdk_message,
    unix_seconds,
)
from nemesis.broker.ydb.reader import zstd_decompress

NAIVE_UTC = datetime.datetime(2026, 11, 30, 12, 0, 0)


def partition_session(committed: int = 40, *, stream: int = 3) -> SdkPartitionSession:
    return SdkPartitionSession(
        id=9,
        state=SdkPartitionSession.State.Active,
        topic_path="/local/orders",
        partition_id=2,
        committed_offset=committed,
        reader_reconnector_id=1,
        reader_stream_id=stream,
    )


def received(
    sdk: SdkPartitionSession,
    offset: int,
    *,
    data: bytes = b"payload",
    items: dict[str, bytes] | None = None,
    producer: str = "shop",
) -> TopicReaderMessage:
    """A message as the SDK builds it from a read response: its commit range chains."""
    start = sdk._next_message_start_commit_offset
    sdk._next_message_start_commit_offset = offset + 1
    return TopicReaderMessage(
        seqno=offset + 100,
        created_at=NAIVE_UTC - datetime.timedelta(seconds=5),
        message_group_id=producer,
        session_metadata={},
        offset=offset,
        written_at=NAIVE_UTC,
        producer_id=producer,
        data=data,
        metadata_items=items if items is not None else {},
        _partition_session=sdk,
        _commit_start_offset=start,
        _commit_end_offset=offset + 1,
    )


def test_a_received_message_maps_to_the_port() -> None:
    sdk = partition_session()
    session = YdbSession("orders", sdk, 4, owner=object())
    items = {"type": b"order.created", KEY_ITEM: b"customer-7", "odd": b"\xff\xfe"}
    message = to_message("orders", received(sdk, 42, items=items), session)
    assert (message.topic, message.partition, message.offset) == ("orders", 2, 42)
    assert (message.value, message.key) == (b"payload", "customer-7")
    # The key item is the key, not metadata; bytes that are not UTF-8 are replaced, not lost.
    assert dict(message.metadata) == {"type": "order.created", "odd": "\ufffd\ufffd"}
    assert (message.producer_id, message.seqno) == ("shop", 142)
    utc = NAIVE_UTC.replace(tzinfo=datetime.UTC).timestamp()
    assert (message.written_at, message.created_at) == (utc, utc - 5)
    assert message.session is session
    assert message.alive


def test_a_message_without_key_or_producer() -> None:
    sdk = partition_session()
    session = YdbSession("t", sdk, 1, owner=object())
    message = to_message("t", received(sdk, 1, producer=""), session)
    assert (message.key, message.producer_id, dict(message.metadata)) == (None, None, {})


def test_data_that_is_not_bytes_is_refused() -> None:
    sdk = partition_session()
    odd = received(sdk, 1)
    odd.data = "text, as a custom decoder would make it"
    with pytest.raises(TypeError, match="bytes"):
        to_message("t", odd, YdbSession("t", sdk, 1, owner=object()))


def alive(session: PartitionSession) -> bool:
    return session.alive


def test_the_session_follows_the_sdks_state_and_is_a_partition_session() -> None:
    sdk = partition_session()
    session = YdbSession("orders", sdk, 4, owner=object())
    assert isinstance(session, PartitionSession)
    assert (session.topic, session.partition, session.id, session.alive) == ("orders", 2, 4, True)
    cast(Callable[[], None], sdk.end)()  # the partition was split: still read and committed
    assert alive(session)
    cast(Callable[[], None], sdk.close)()  # stopped by the server, or by a reconnect
    assert not alive(session)
    assert "dead" in repr(session)


def test_the_private_attributes_the_adapter_relies_on_exist_in_this_sdk() -> None:
    sdk = partition_session(stream=11)
    message = received(sdk, 40)
    assert sdk_session(message) is sdk
    assert session_key(sdk) == (11, 9)


def test_a_run_of_messages_commits_as_one_chained_range() -> None:
    sdk = partition_session(committed=40)
    run = [received(sdk, offset) for offset in (40, 41, 43)]  # 42 was deleted by retention
    batch = TopicReaderBatch(
        messages=run, _partition_session=sdk, _bytes_size=0, _codec=Codec(Codec.CODEC_RAW)
    )
    # What YdbReader.commit hands the SDK: from the session's committed offset to last + 1.
    assert batch._commit_get_offsets_range() == OffsetsRange(40, 44)
    following = [received(sdk, 44)]
    assert following[0]._commit_get_offsets_range() == OffsetsRange(44, 45)


def test_an_outgoing_message_maps_to_the_sdk_writer() -> None:
    outgoing = OutgoingMessage(
        value=b"body", key="k-1", metadata={"type": "t"}, created_at=1_800_000_000.5
    )
    sdk = to_sdk_message(outgoing, 17, now=0.0)
    assert (sdk.data, sdk.seqno) == (b"body", 17)
    assert sdk.metadata_items == {"type": "t", KEY_ITEM: "k-1"}
    assert sdk.created_at == datetime.datetime.fromtimestamp(1_800_000_000.5, datetime.UTC)
    # What the SDK puts on the wire.
    wire = InternalMessage(sdk)
    assert wire.metadata_items == {"type": b"t", KEY_ITEM: b"k-1"}
    assert (wire.seq_no, wire.uncompressed_size) == (17, 4)
    unkeyed = to_sdk_message(OutgoingMessage(value=b""), None, now=1_800_000_000.0)
    assert unkeyed.metadata_items == {}
    assert unkeyed.seqno is None
    assert unkeyed.created_at == datetime.datetime.fromtimestamp(1_800_000_000.0, datetime.UTC)


def test_unix_seconds_of_sdk_times() -> None:
    aware = datetime.datetime(
        2026, 1, 1, 3, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=3))
    )
    assert unix_seconds(aware) == datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()
    assert unix_seconds(datetime.datetime(1970, 1, 1)) == 0.0
    assert unix_seconds(None) == 0.0


def test_an_sdk_reader_without_a_stream_has_no_partition_sessions() -> None:
    # Before its first connect (or if a later SDK moved the table): none, not an error.
    assert sdk_partition_sessions(cast(TopicReaderAsyncIO, object())) == []


def test_undecodable_data_keeps_its_bytes_and_its_codec() -> None:
    data = Undecodable(b"lzop-bytes", Codec.CODEC_LZOP)
    assert data == b"lzop-bytes"
    assert data.codec == Codec.CODEC_LZOP
    assert zstd_decompress(zstandard.compress(b"x" * 1000)) == b"x" * 1000

"""The sans-IO WebSocket connection (duplexrt.wire.connection) by plain calls: bytes in, events
out, the closing handshake's state and the ending reason, with a hostile peer's bytes."""

from __future__ import annotations

import struct

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.connection import Connection, ConnectionState
from duplexrt.wire.frames import Close, FrameError, FrameParser, Opcode, Ping, Pong, frame


def _server(**options) -> Connection:
    return Connection(client=False, max_message=options.get("max_message", 1 << 20))


def _client_frames(*frames: tuple[int, bytes]) -> bytes:
    return b"".join(frame(opcode, payload, masked=True) for opcode, payload in frames)


def _sent(data: bytes | None) -> object:
    """What a client's parser reads out of the bytes a server end wrote."""
    assert data is not None
    parser = FrameParser(masked=False, max_message=1 << 20)
    parser.feed(data)
    return parser.next()


def test_messages_are_queued_and_pongs_counted_until_an_event_that_needs_an_answer():
    connection = _server()
    connection.parser.feed(_client_frames((Opcode.BINARY, b"one"), (Opcode.PONG, b""), (Opcode.TEXT, b"two"),
                                          (Opcode.PING, b"there?"), (Opcode.BINARY, b"after")))
    messages: list = []
    event = connection.receive_into(messages)
    assert messages == [b"one", "two"] and connection.pongs == 1
    assert event == Ping(b"there?") and type(event) is Ping
    pong = _sent(connection.pong(event))
    assert type(pong) is Pong and pong == b"there?"
    assert connection.receive_into(messages) is None and messages == [b"one", "two", b"after"]
    assert connection.state is ConnectionState.OPEN and connection.receive_error() is None


def test_a_message_in_fragments_across_feeds_comes_whole_and_once():
    connection = _server()
    data = frame(Opcode.BINARY, b"abc", masked=True)
    first = bytes((data[0] & 0x7F,)) + data[1:]  # not final
    rest = frame(Opcode.CONTINUATION, b"def", masked=True)
    messages: list = []
    for chunk in (first[:3], first[3:], rest[:1], rest[1:]):
        connection.parser.feed(chunk)
        assert connection.receive_into(messages) is None
    assert messages == [b"abcdef"]


def test_the_peers_close_moves_the_state_and_is_what_a_receive_raises_then_answered_once():
    connection = _server()
    connection.parser.feed(_client_frames((Opcode.CLOSE, struct.pack("!H", 1001) + b"bye")))
    event = connection.receive_into([])
    assert isinstance(event, Close) and (event.code, event.reason) == (1001, "bye")
    assert connection.state is ConnectionState.CLOSE_RECEIVED and not connection.reading
    error = connection.receive_error()
    assert error is not None and (error.code, error.reason, error.finish_reason) == (1001, "bye", None)
    answer = connection.close(1001, "")
    assert isinstance(_sent(answer), Close) and connection.state is ConnectionState.CLOSED
    assert connection.close(1000, "again") is None  # one Close, whoever asks twice
    assert connection.send_error() is not None


def test_a_broken_frame_ends_the_connection_with_its_code_and_this_ends_reason():
    connection = _server(max_message=8)
    connection.parser.feed(_client_frames((Opcode.BINARY, b"x" * 20)))
    event = connection.receive_into([])
    assert isinstance(event, FrameError) and event.code == CloseCode.MESSAGE_TOO_BIG
    assert connection.failed and not connection.reading
    assert connection.ended is not None and connection.ended.finish_reason == FinishReason.MESSAGE_TOO_BIG
    assert connection.receive_error() is connection.ended
    close = _sent(connection.close(event.code, event.reason))
    assert isinstance(close, Close) and close.code == CloseCode.MESSAGE_TOO_BIG
    assert connection.state is ConnectionState.CLOSE_SENT and connection.pong(Ping(b"late")) is None


def test_an_unmasked_client_frame_is_a_protocol_error():
    connection = _server()
    connection.parser.feed(frame(Opcode.BINARY, b"bare"))
    event = connection.receive_into([])
    assert isinstance(event, FrameError) and event.code == CloseCode.PROTOCOL_ERROR
    assert connection.ended.finish_reason == FinishReason.PROTOCOL_ERROR


def test_a_drop_is_gone_with_no_close_to_send_and_the_first_ending_reason_stays():
    connection = _server()
    connection.stream_ended()
    assert connection.gone is not None and connection.gone.code == CloseCode.ABNORMAL_CLOSURE
    assert connection.close(1000, "") is None  # nobody to tell
    assert connection.closed_error() is connection.gone
    first = connection.end(FinishReason.PING_TIMEOUT, CloseCode.GOING_AWAY, "no pong")
    assert connection.end(FinishReason.IDLE_TIMEOUT, CloseCode.POLICY_VIOLATION, "idle") is first


def test_after_this_end_shuts_its_reading_the_streams_end_is_no_drop_and_sends_still_go():
    connection = _server()
    connection.end(FinishReason.IDLE_TIMEOUT, CloseCode.POLICY_VIOLATION, "idle")
    connection.shut_reading()
    connection.stream_ended()
    assert connection.eof and connection.gone is None and connection.send_error() is None
    assert connection.receive_error().finish_reason == FinishReason.IDLE_TIMEOUT
    assert connection.frame("the end")[1] == b"the end"

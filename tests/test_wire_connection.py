"""The sans-IO WebSocket connection (duplexrt.wire.connection) by plain calls: bytes in, events
out, the closing handshake's state and the ending reason, with a hostile peer's bytes."""

from __future__ import annotations

import struct
from collections import deque

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.connection import Connection, ConnectionState
from duplexrt.wire.frames import Close, FrameError, FrameParser, Opcode, Ping, Pong, frame


def _server(**options) -> Connection:
    return Connection(client=False, max_message=options.get("max_message", 1 << 20))


def _client_frames(*frames: tuple[int, bytes]) -> bytes:
    return b"".join(frame(opcode, payload, masked=True) for opcode, payload in frames)


def _all_sent(data: bytes | None) -> list:
    """Every frame in the bytes a server end wrote."""
    assert data is not None
    parser = FrameParser(masked=False, max_message=1 << 20)
    parser.feed(data)
    return list(iter(parser.next, None))


def _sent(data: bytes | None) -> object:
    """What a client's parser reads out of the bytes a server end wrote."""
    assert data is not None
    parser = FrameParser(masked=False, max_message=1 << 20)
    parser.feed(data)
    return parser.next()


def test_messages_are_queued_and_pongs_counted_and_the_ping_comes_back_once_the_bytes_run_out():
    connection = _server()
    connection.parser.feed(_client_frames((Opcode.BINARY, b"one"), (Opcode.PONG, b""), (Opcode.TEXT, b"two"),
                                          (Opcode.PING, b"there?"), (Opcode.BINARY, b"after")))
    messages: list = []
    event = connection.receive_into(messages)
    assert messages == [b"one", "two", b"after"] and connection.pongs == 1
    assert event == Ping(b"there?") and type(event) is Ping
    pong = _sent(connection.answer_pings())
    assert type(pong) is Pong and pong == b"there?"
    assert connection.answer_pings() is None  # answered once
    assert connection.receive_into(messages) is None and messages == [b"one", "two", b"after"]
    assert connection.state is ConnectionState.OPEN and connection.receive_error() is None


def test_a_burst_of_pings_read_together_is_answered_in_one_write_for_the_latest_few():
    from duplexrt.wire.connection import PONGS_PER_BURST

    connection = _server()
    connection.parser.feed(_client_frames(*[(Opcode.PING, b"%d" % i) for i in range(50)]))
    assert connection.receive_into([]) == Ping(b"49")
    assert _all_sent(connection.answer_pings()) == [Pong(b"%d" % i) for i in range(50 - PONGS_PER_BURST, 50)]
    assert connection.receive_into([]) is None and connection.answer_pings() is None
    connection.parser.feed(_client_frames(*[(Opcode.PING, b"%d" % i) for i in range(10)]))
    assert connection.receive_into([]) == Ping(b"9")
    assert _all_sent(connection.answer_pings()) == [Pong(b"%d" % i) for i in range(10)]  # a few: each answered


def test_a_close_after_a_ping_comes_back_after_it_so_the_ping_is_answered_first():
    connection = _server()
    connection.parser.feed(_client_frames((Opcode.PING, b"a"), (Opcode.PING, b"b"), (Opcode.CLOSE, b"")))
    assert connection.receive_into([]) == Ping(b"b")
    assert connection.state is ConnectionState.CLOSE_RECEIVED  # recorded already
    assert _all_sent(connection.answer_pings()) == [Pong(b"a"), Pong(b"b")]
    close = connection.receive_into([])
    assert isinstance(close, Close) and close.code == 1005
    assert connection.receive_into([]) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _control_flood(connection: Connection, clock: _Clock, count: int, per_second: float) -> object:
    """``count`` pings and pongs, one at a time at ``per_second``: the first event that is not
    a ping (or None)."""
    for i in range(count):
        clock.now += 1 / per_second
        connection.parser.feed(_client_frames((Opcode.PONG if i % 2 else Opcode.PING, b"x")))
        event = connection.receive_into([])
        if type(event) is not Ping and event is not None:
            return event
    return None


def test_control_frames_above_the_rate_close_with_1008_and_below_it_never():
    clock = _Clock()
    calm = Connection(client=False, max_message=1 << 20, clock=clock)
    assert _control_flood(calm, clock, 2000, per_second=90) is None and calm.ended is None
    clock = _Clock()
    flooded = Connection(client=False, max_message=1 << 20, clock=clock)
    error = _control_flood(flooded, clock, 2000, per_second=120)
    assert isinstance(error, FrameError) and error.code == CloseCode.POLICY_VIOLATION
    assert "control frames a second" in error.reason and clock.now < 2.0  # within its first window
    assert flooded.ended is not None and flooded.ended.code == CloseCode.POLICY_VIOLATION
    assert flooded.ended.finish_reason == FinishReason.PROTOCOL_ERROR and flooded.failed


def test_a_burst_above_the_rate_within_the_window_allowance_is_fine():
    clock = _Clock()
    connection = Connection(client=False, max_message=1 << 20, clock=clock)
    connection.parser.feed(_client_frames(*[(Opcode.PING, b"")] * 150))  # at once, then quiet
    assert connection.receive_into([]) == Ping(b"")
    clock.now += 10
    assert _control_flood(connection, clock, 300, per_second=50) is None and connection.ended is None


def test_empty_continuations_past_the_fragment_cap_end_the_connection_with_1009():
    connection = _server()
    start = frame(Opcode.BINARY, b"", masked=True)
    empty = frame(Opcode.CONTINUATION, b"", masked=True)
    not_final = bytes((start[0] & 0x7F,)) + start[1:] + (bytes((empty[0] & 0x7F,)) + empty[1:]) * 5000
    connection.parser.feed(not_final)
    error = connection.receive_into([])
    assert isinstance(error, FrameError) and error.code == CloseCode.MESSAGE_TOO_BIG
    assert connection.ended is not None and connection.ended.finish_reason == FinishReason.MESSAGE_TOO_BIG


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
    assert connection.state is ConnectionState.CLOSE_SENT
    connection.parser = FrameParser(masked=True, max_message=1 << 20)  # a ping read after the Close went
    connection.parser.feed(_client_frames((Opcode.PING, b"late")))
    connection.failed = False
    assert connection.receive_into([]) == Ping(b"late") and connection.answer_pings() is None


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


def test_a_read_of_many_messages_is_parsed_a_batch_at_a_time_as_they_are_taken():
    from duplexrt.wire.connection import PARSE_BATCH

    connection = _server()
    connection.parser.feed(_client_frames(*[(Opcode.BINARY, b"%d" % i) for i in range(PARSE_BATCH * 2 + 5)]))
    messages: deque = deque()
    assert connection.receive_into(messages) is None
    assert len(messages) == PARSE_BATCH and connection.backlog  # the rest waits in the parser's buffer
    assert connection.receive_into(messages) is None and len(messages) == 2 * PARSE_BATCH  # a batch a call
    taken = []
    while messages or connection.backlog:
        taken.extend(messages)
        messages.clear()
        connection.receive_into(messages)
    assert taken == [b"%d" % i for i in range(PARSE_BATCH * 2 + 5)] and not connection.backlog

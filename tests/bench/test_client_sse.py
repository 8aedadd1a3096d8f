from pdserve.bench.client import error_message, sse_events


async def collect(lines):
    async def gen():
        for line in lines:
            yield line

    return [event async for event in sse_events(gen())]


async def test_sse_events_join_multiline_data_and_skip_comments():
    lines = [": keep-alive", "", "data: {\"a\":", "data: 1}", "", "event: x", "data:[DONE]", "\r"]
    assert await collect(lines) == ['{"a":\n1}', "[DONE]"]


async def test_sse_event_without_trailing_blank_line_is_kept():
    assert await collect(["data: last"]) == ["last"]


def test_error_message_reads_openai_error_bodies():
    assert error_message(b'{"error": {"message": "bad  model", "type": "x"}}') == "bad model"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"<html>oops</html>") == "<html>oops</html>"
    assert error_message("x" * 500, limit=20) == "x" * 17 + "..."

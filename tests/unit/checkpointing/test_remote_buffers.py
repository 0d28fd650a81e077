from __future__ import annotations

import io

import pytest

from checkpointing.remote_buffers import BufferBody, BufferPool


def test_body_reads_seeks_and_slices_like_bytes() -> None:
    data = bytearray(range(256)) * 4
    body = BufferBody(data)
    assert len(body) == 1024 and isinstance(body, io.BytesIO)
    assert body.read(10) == bytes(range(10)) and body.tell() == 10
    assert body.seek(-4, io.SEEK_END) == 1020 and body.read() == bytes(range(252, 256))
    assert body.read(5) == b""
    body.seek(0)
    target = bytearray(300)
    assert body.readinto(target) == 300 and target == data[:300]
    assert bytes(body.getbuffer()) == bytes(data) and body.getvalue() == bytes(data)
    part = body[256:260]
    assert len(part) == 4 and part.read() == bytes(range(4))
    with pytest.raises(io.UnsupportedOperation):
        body.write(b"x")


def test_body_shares_the_buffer_and_closing_it_lets_the_buffer_resize() -> None:
    data = bytearray(b"abcdef")
    body = BufferBody(data)
    data[0:1] = b"z"  # same length: allowed while viewed, and seen through the body
    assert body.read(1) == b"z"
    with pytest.raises(BufferError):
        data.append(0)
    body.close()
    data.append(0)
    assert len(data) == 7


def test_pool_hands_back_the_same_buffer_and_drops_one_still_viewed() -> None:
    pool = BufferPool()
    buf = pool.acquire()
    buf += b"x" * 1000
    pool.release(buf)
    assert pool.retained_bytes == 1000
    again = pool.acquire()
    assert again is buf and pool.retained_bytes == 0
    view = memoryview(again)
    pool.release(again)  # a view outlived the upload: must not be written into again
    assert pool.acquire() is not again
    view.release()
    pool.release(buf)
    pool.clear()
    assert pool.retained_bytes == 0

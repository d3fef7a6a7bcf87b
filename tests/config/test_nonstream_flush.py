"""router.nonstream_flush_ms / stream_flush_ms: acted on (Steps stream) or refused at start."""

import pytest

from pdserve.config.cluster import RouterConfig


def test_nonstream_flush_is_refused_with_the_per_request_stream() -> None:
    with pytest.raises(ValueError, match="nonstream_flush_ms"):
        RouterConfig(decode_stream="per_request", nonstream_flush_ms=50)
    assert RouterConfig(decode_stream="per_request").nonstream_flush_ms == 100  # default: unused, allowed


def test_nonstream_flush_over_half_the_inter_token_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="inter_token_timeout_s"):
        RouterConfig(nonstream_flush_ms=8000, inter_token_timeout_s=15.0)


def test_stream_flush_is_refused_with_the_per_request_stream_or_over_half_the_timeout() -> None:
    with pytest.raises(ValueError, match="stream_flush_ms"):
        RouterConfig(decode_stream="per_request", stream_flush_ms=20)
    with pytest.raises(ValueError, match=r"stream_flush_ms \(9000\).*inter_token_timeout_s"):
        RouterConfig(stream_flush_ms=9000, inter_token_timeout_s=15.0)
    # the default (10 ms) is unused there, and allowed, as is an explicit 0 (every step)
    assert RouterConfig(decode_stream="per_request").stream_flush_ms == 10
    assert RouterConfig(decode_stream="per_request", stream_flush_ms=0).stream_flush_ms == 0
    assert RouterConfig(stream_flush_ms=50).stream_flush_ms == 50


def test_pd_decode_leg_with_prefill_needs_the_steps_stream() -> None:
    """router.pd_decode_leg: with_prefill (the default) is acted on with the multiplexed Steps
    stream; asked for explicitly with per_request it is refused at start, naming both settings."""
    assert RouterConfig().pd_decode_leg == "with_prefill"
    with pytest.raises(
        ValueError, match=r"pd_decode_leg with_prefill needs router\.decode_stream multiplexed"
    ):
        RouterConfig(decode_stream="per_request", pd_decode_leg="with_prefill")
    assert RouterConfig(decode_stream="per_request").pd_decode_leg == "with_prefill"  # default: unused
    assert (
        RouterConfig(decode_stream="per_request", pd_decode_leg="after_prefill").decode_stream
        == "per_request"
    )
    with pytest.raises(ValueError, match="pd_decode_leg"):
        RouterConfig(pd_decode_leg="sometimes")

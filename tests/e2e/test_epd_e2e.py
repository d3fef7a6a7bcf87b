"""Images through real processes: router -> encoder (gRPC) -> prefill (embeddings pulled from the
encoder's registered memory over Mooncake TCP, index in a real redis-server) -> decode (KV only),
with the official openai client, against transformers' LlavaForConditionalGeneration.generate."""

from __future__ import annotations

import base64
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch

from tests.e2e.cluster import running_cluster
from tests.e2e.epd_cluster import LlavaReference, epd_config, image_part, metric, png

pytest.importorskip("mooncake.engine")
pytest.importorskip("PIL")
pytestmark = pytest.mark.slow

LEASE_S = 3.0
N = 8  # output tokens


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from pdserve.models.make_model import make_tiny_model

    return make_tiny_model("llava", tmp_path_factory.mktemp("llava-e2e"))


@pytest.fixture(scope="module")
def redis_url():
    from tests.registry.redis_proc import RedisProcess

    r = RedisProcess().start()
    yield r.url
    r.stop()


@pytest.fixture(scope="module")
def epd(llava_dir, redis_url, tmp_path_factory):
    cfg = epd_config(llava_dir, redis_url, lease_s=LEASE_S)
    with running_cluster(cfg, tmp_path_factory.mktemp("epd-e2e")) as rc:
        _wait_for_the_image_path(rc)
        yield rc


def _wait_for_the_image_path(rc, timeout_s: float = 60.0) -> None:
    """The router's /ready needs a decode node only; image requests also need the prefill node,
    which the router learns from the Redis registry a moment later (until then they get a clean
    503). Send one image request until it is served, so the tests start with every node known."""
    client = openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0, timeout=60)
    content = [image_part(png(seed=4242)), {"type": "text", "text": "warm-up"}]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.chat.completions.create(
                model=rc.model_name, messages=[{"role": "user", "content": content}], max_tokens=1
            )
            return
        except openai.APIStatusError as e:
            if e.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def ref(llava_dir):
    return LlavaReference(llava_dir)


def _client(rc) -> openai.OpenAI:
    return openai.OpenAI(base_url=rc.base_url, api_key="unused", max_retries=0, timeout=60)


def _chat(rc, parts: list[dict], text: str = "What is in the picture?"):
    return _client(rc).chat.completions.create(
        model=rc.model_name,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        max_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def _encoder_metric(rc, name: str) -> float:
    return metric(f"http://{rc.node('encoder-0').metrics_address}/metrics", name)


def _index_keys(redis_url: str) -> list[str]:
    from pdserve.embedcache.index import EmbeddingIndex

    return EmbeddingIndex.from_url(redis_url).keys()


def _wait_nothing_held(rc) -> None:
    deadline = time.monotonic() + 5
    while True:
        reps = [rc.load("prefill-0"), rc.load("decode-0")]
        state = [
            (r.num_blocks_used, r.num_held_requests, r.num_blocks_held_for_transfer, r.num_ec_reservations)
            for r in reps
        ]
        if all(s == (0, 0, 0, 0) for s in state):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held (blocks, requests, transfer blocks, ec reservations): {state}")
        time.sleep(0.1)


def test_four_concurrent_images_match_transformers(epd, ref) -> None:
    images = [png(10 + i, fmt=f) for i, f in enumerate(["PNG", "JPEG", "WEBP", "PNG"])]
    mimes = ["png", "jpeg", "webp", "png"]
    with ThreadPoolExecutor(4) as pool:
        resps = list(pool.map(lambda i: _chat(epd, [image_part(images[i], mimes[i])]), range(4)))
    for i, r in enumerate(resps):
        want = ref.greedy("What is in the picture?", [images[i]], N)
        assert r.choices[0].message.content == ref.tok.decode(want, skip_special_tokens=True), f"image {i}"
        assert r.usage.completion_tokens == N
        assert r.usage.prompt_tokens == len(ref.prompt_ids("What is in the picture?", 1))
    before = metric(
        epd.cluster.router_url + "/metrics", 'pdserve:router_requests_by_path_total{path="local"}'
    )
    assert before == 0, "image requests never prefill on decode"
    _wait_nothing_held(epd)


def test_two_images_in_one_message_match_transformers(epd, ref) -> None:
    a, b = png(21), png(22, size=40)
    r = _chat(epd, [image_part(a), image_part(b)], "Compare them.")
    want = ref.greedy("Compare them.", [a, b], N)
    assert r.choices[0].message.content == ref.tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ref.prompt_ids("Compare them.", 2))
    _wait_nothing_held(epd)


def test_same_image_twice_runs_the_encoder_once(epd, ref) -> None:
    img, other = png(31), png(32)
    encoded0 = _encoder_metric(epd, "pdserve:encoder_images_encoded_total")
    hits0 = _encoder_metric(epd, "pdserve:ec_cache_hits_total")
    pushed0 = _encoder_metric(epd, "pdserve:ec_bytes_pushed_total")
    router_metrics = epd.cluster.router_url + "/metrics"
    routed0 = metric(router_metrics, 'pdserve:router_images_total{source="encoder"}')
    first = _chat(epd, [image_part(img)]).choices[0].message.content
    second = _chat(epd, [image_part(img)]).choices[0].message.content
    assert first == second
    assert _encoder_metric(epd, "pdserve:encoder_images_encoded_total") - encoded0 == 1
    assert _encoder_metric(epd, "pdserve:ec_cache_hits_total") - hits0 == 1
    assert metric(router_metrics, 'pdserve:router_images_total{source="encoder"}') - routed0 == 2
    # every prefill pulled the embedding from the encoder's memory (16 tokens x 64 hidden x fp32)
    assert _encoder_metric(epd, "pdserve:ec_bytes_pushed_total") - pushed0 == 2 * 16 * 64 * 4
    prefill_metrics = f"http://{epd.node('prefill-0').metrics_address}/metrics"
    assert metric(prefill_metrics, "pdserve:ec_bytes_received_total") >= 2 * 16 * 64 * 4
    # the same text with another image: its own answer (transformers agrees), no shared blocks
    third = _chat(epd, [image_part(other)]).choices[0].message.content
    want_other = ref.tok.decode(ref.greedy("What is in the picture?", [other], N), skip_special_tokens=True)
    assert third == want_other
    if want_other != first:
        assert third != first


def test_precomputed_image_embeds_match_transformers(epd, ref) -> None:
    from safetensors.torch import save

    from pdserve.models.image_processor import ImageLimits, decode_image

    img = png(41)
    with torch.no_grad():
        px = ref.processor(decode_image(img, ImageLimits()))[None]
        emb = ref.model.get_image_features(pixel_values=px)
        emb = (emb.pooler_output if hasattr(emb, "pooler_output") else emb)[0]
        emb = emb.reshape(-1, emb.shape[-1]).contiguous()
    part = {"type": "image_embeds", "image_embeds": base64.b64encode(save({"e": emb})).decode()}
    encoded0 = _encoder_metric(epd, "pdserve:encoder_images_encoded_total")
    r = _chat(epd, [part])
    want = ref.greedy("What is in the picture?", [img], N)
    assert r.choices[0].message.content == ref.tok.decode(want, skip_special_tokens=True)
    assert _encoder_metric(epd, "pdserve:encoder_images_encoded_total") == encoded0, "no encoder run"
    _wait_nothing_held(epd)


def test_malformed_images_are_400s_and_nothing_is_left(epd, redis_url) -> None:
    from safetensors.torch import save

    good = png(51)
    bad_parts = [
        (image_part(good[: len(good) // 2]), "image"),  # truncated
        (image_part(b"this is not an image at all"), "image"),
        (image_part(png(52, size=100)), "max_image_pixels"),  # 10,000 pixels > 64 x 64
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote image URLs"),
    ]
    for t, needle in (
        (torch.ones(16, 63), "shape"),
        (torch.ones(16, 64, dtype=torch.int32), "dtype"),
        (torch.full((16, 64), float("nan")), "NaN"),
    ):
        bad_parts.append(
            ({"type": "image_embeds", "image_embeds": base64.b64encode(save({"e": t})).decode()}, needle)
        )
    encoded0 = _encoder_metric(epd, "pdserve:encoder_images_encoded_total")
    for part, needle in bad_parts:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(epd, [part])
        body = e.value.body
        assert isinstance(body, dict) and needle in body["message"], (needle, body)
        assert body["type"] == "invalid_request_error"
    assert _encoder_metric(epd, "pdserve:encoder_images_encoded_total") == encoded0
    _wait_nothing_held(epd)
    time.sleep(LEASE_S + 0.5)
    assert _index_keys(redis_url) == [], "every entry expires with its lease"


def test_killing_the_encoder_mid_request(epd, redis_url) -> None:
    """Last in the module: the encoder does not come back."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.rpc import convert
    from pdserve.rpc import node_pb2 as pb
    from pdserve.rpc import node_pb2_grpc as pb_grpc

    enc = next(c for c in epd.children if c.name == "encoder-0")
    enc_addr = epd.node("encoder-0").grpc_address
    img = png(61)
    with grpc.insecure_channel(enc_addr) as ch:
        item = (
            pb_grpc.EncoderServiceStub(ch)
            .Encode(pb.EncodeRequest(request_id="t", images=[pb.EncodeImage(data=img)]), timeout=30)
            .items[0]
        )
    # Freeze the encoder, so prefill's fetch (PushEmbeddings) hangs with its reservation held.
    os.kill(enc.proc.pid, signal.SIGSTOP)
    prompt = [1] * 4 + [7] * item.length + [2, 3]  # 4 text tokens, the image's run, 2 more
    result: dict[str, object] = {}

    def prefill() -> None:
        with grpc.insecure_channel(epd.node("prefill-0").grpc_address) as ch:
            try:
                pb_grpc.PrefillServiceStub(ch).Prefill(
                    pb.PrefillRequest(
                        transfer_id="kill-test",
                        prompt_token_ids=prompt,
                        sampling=convert.sampling_to_pb(SamplingParams(max_tokens=4)),
                        need_send=1,
                        mm_items=[
                            pb.MmItem(offset=4, length=item.length, key=item.key, encoder_address=enc_addr)
                        ],
                    ),
                    timeout=60,
                )
                result["code"] = "OK"
            except grpc.RpcError as e:
                result["code"] = e.code()
                result["details"] = e.details()

    t = threading.Thread(target=prefill)
    t.start()
    deadline = time.monotonic() + 10
    while epd.load("prefill-0").num_ec_reservations != 1:
        assert time.monotonic() < deadline, f"prefill never reserved room for the embedding: {result}"
        time.sleep(0.05)
    # A request through the router now waits on the frozen encoder's Encode.
    router_result: dict[str, object] = {}

    def via_router() -> None:
        t0 = time.monotonic()
        try:
            _chat(epd, [image_part(png(62))])
            router_result["error"] = None
        except openai.APIStatusError as e:
            router_result["error"] = e
        router_result["s"] = time.monotonic() - t0

    rt = threading.Thread(target=via_router)
    rt.start()
    time.sleep(0.5)
    t_kill = time.monotonic()
    enc.proc.kill()
    enc.proc.wait(timeout=10)
    t.join(timeout=15)
    rt.join(timeout=15)
    assert not t.is_alive() and not rt.is_alive()
    assert time.monotonic() - t_kill < 10, "a clean error soon after the kill, not at a timeout"
    assert result["code"] == grpc.StatusCode.FAILED_PRECONDITION, result
    assert "could not push" in str(result["details"])
    err = router_result["error"]
    assert isinstance(err, openai.APIStatusError) and err.status_code == 503, router_result
    assert "encoder" in err.message
    _wait_nothing_held(epd)
    # the dead encoder's entries expire with their lease
    time.sleep(LEASE_S + 0.5)
    assert _index_keys(redis_url) == []


@pytest.fixture(scope="module")
def no_encoder(llava_dir, tmp_path_factory):
    cfg = epd_config(llava_dir, None, encoder=False)
    with running_cluster(cfg, tmp_path_factory.mktemp("pd-llava")) as rc:
        yield rc


def test_prefill_without_encoder_rejects_embedding_only_items(no_encoder) -> None:
    """The rejecting role: a prefill node of a multimodal model with no encoder in the cluster is
    not an EC consumer (accept_mm_embeds false): image items are a 400 / INVALID_ARGUMENT."""
    from safetensors.torch import save

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.rpc import convert
    from pdserve.rpc import node_pb2 as pb
    from pdserve.rpc import node_pb2_grpc as pb_grpc

    emb = torch.randn(16, 64)
    part = {"type": "image_embeds", "image_embeds": base64.b64encode(save({"e": emb})).decode()}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(no_encoder, [part])
    assert "accept_mm_embeds" in e.value.body["message"]
    # the node itself, over gRPC: an item without its tensor
    with grpc.insecure_channel(no_encoder.node("prefill-0").grpc_address) as ch:
        with pytest.raises(grpc.RpcError) as g:
            pb_grpc.PrefillServiceStub(ch).Prefill(
                pb.PrefillRequest(
                    transfer_id="x",
                    prompt_token_ids=[1] * 20,
                    sampling=convert.sampling_to_pb(SamplingParams(max_tokens=2)),
                    need_send=1,
                    mm_items=[pb.MmItem(offset=2, length=16, key="sha256:00")],
                ),
                timeout=30,
            )
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "accept_mm_embeds" in g.value.details()
    # text still works on this cluster
    r = _client(no_encoder).chat.completions.create(
        model=no_encoder.model_name, messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert r.usage.completion_tokens >= 1


def test_encoder_colocated_in_prefill_matches_transformers(no_encoder, ref) -> None:
    """No encoder node: prefill runs the vision tower itself (on its engine thread); a repeat is
    served from its in-process cache; decode still gets only keys."""
    a, b = png(81), png(82, fmt="JPEG")
    prefill_metrics = f"http://{no_encoder.node('prefill-0').metrics_address}/metrics"
    enc0 = metric(prefill_metrics, "pdserve:encoder_images_encoded_total")
    r = _chat(no_encoder, [image_part(a), image_part(b, "jpeg")], "Compare them.")
    want = ref.greedy("Compare them.", [a, b], N)
    assert r.choices[0].message.content == ref.tok.decode(want, skip_special_tokens=True)
    r2 = _chat(no_encoder, [image_part(a)])
    want2 = ref.greedy("What is in the picture?", [a], N)
    assert r2.choices[0].message.content == ref.tok.decode(want2, skip_special_tokens=True)
    assert metric(prefill_metrics, "pdserve:encoder_images_encoded_total") - enc0 == 2
    assert metric(prefill_metrics, "pdserve:ec_cache_hits_total") >= 1
    with pytest.raises(openai.BadRequestError) as e:
        _chat(no_encoder, [image_part(b"not an image")])
    assert "image" in e.value.body["message"]
    _wait_nothing_held(no_encoder)

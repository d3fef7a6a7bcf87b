"""Compose is not fiction: docker-compose.yml's and the cpu-tiny overlay's containers, started
as local processes with their own argv, env, mounted cluster file and health checks (see
local_run.py for the few stand-ins), must serve an OpenAI request through the router."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from pdserve.registry.redis_registry import RedisRegistry
from tests.deploy.local_run import LocalService, LocalStack, build_image_model
from tests.deploy.stacks import compose_stack, k8s_stack

pytestmark = pytest.mark.slow
PROMPT = "Disaggregated serving splits prefill from decode so that each runs where it fits best. " * 2


@pytest.fixture(scope="module")
def image_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_image_model(tmp_path_factory.mktemp("image") / "tiny-llama")


def registered(redis_url: str) -> dict[str, str]:
    async def go() -> dict[str, str]:
        reg = RedisRegistry(redis_url)
        try:
            return {e.name: e.address for e in await reg.list_nodes()}
        finally:
            await reg.close()

    return asyncio.run(go())


def wait_in_rotation(base: str, names: list[str], timeout_s: float = 30.0) -> None:
    """Until the router has every node in ``names`` in rotation. /ready needs only a decode node
    (without a prefill node prompts prefill on decode), so a prompt sent right after it may take
    the local path: seen once in CI when prefill-0 registered a poll after decode-0."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(base + "/metrics").text
        up = {n for n in names if re.search(rf'router_node_in_rotation\{{node="{n}"\}} 1\.0', text)}
        if up == set(names):
            return
        assert time.monotonic() < deadline, (
            f"not in the router's rotation after {timeout_s} s: {set(names) - up}"
        )
        time.sleep(0.2)


def serve_and_check(
    build: Callable[[Path, Path], tuple[list[LocalService], dict[str, Any], list[str]]],
    tmp_path: Path,
    image_model: Path,
) -> None:
    services, cluster, skipped = build(tmp_path, image_model)
    # The encoder runs in neither default stack (a text-only demo model; see docker-compose.yml).
    assert all("encoder" in name for name in skipped), skipped
    stack = LocalStack(services, tmp_path)
    try:
        stack.start()
        base = f"http://127.0.0.1:{cluster['router']['port']}"
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [cluster["served_model_name"]]
        wait_in_rotation(base, ["prefill-0", "decode-0"])
        resp = client.completions.create(
            model=cluster["served_model_name"],
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 8
        assert resp.usage.prompt_tokens >= 32 and resp.choices[0].finish_reason == "length"
        # The prompt is long enough to go prefill -> Mooncake KV -> decode, between "containers".
        m = re.search(
            r'router_requests_by_path_total\{path="disaggregated"\} ([0-9.]+)',
            httpx.get(base + "/metrics").text,
        )
        assert m and float(m.group(1)) == 1.0
        nodes = {n["name"]: f"127.0.0.1:{n['grpc_port']}" for n in cluster["nodes"]}
        reg = registered(cluster["redis_url"])
        assert reg == {k: nodes[k] for k in ("prefill-0", "decode-0")}
    except BaseException:
        print(stack.logs())
        raise
    finally:
        codes = stack.stop()
    assert codes == {s.name: 0 for s in services}, f"exit codes {codes}\n{stack.logs()}"


def test_docker_compose_services_serve_an_openai_text_request(tmp_path: Path, image_model: Path) -> None:
    serve_and_check(compose_stack, tmp_path, image_model)


def test_k8s_cpu_tiny_containers_serve_an_openai_text_request(tmp_path: Path, image_model: Path) -> None:
    serve_and_check(lambda run, model: k8s_stack("cpu-tiny", run, model), tmp_path, image_model)


@pytest.mark.skipif(
    not os.environ.get("PDSERVE_FULL_TESTS"),
    reason="~30 s on 2 cores: PDSERVE_FULL_TESTS=1 runs it (CI checks the encoder path through "
    "tests/e2e/test_up.py's multimodal start and tests/e2e/test_epd_e2e.py)",
)
def test_image_request_through_the_encoder(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`docker compose --profile multimodal up` with the cluster file's model set to the image's
    LLaVA: the encoder container encodes, prefill fetches the embedding over Mooncake, decode
    streams; the encoder's metrics count the image."""
    import base64
    import io

    from PIL import Image

    from tests.deploy.local_run import IMAGE_LLAVA_DIR

    llava = build_image_model(tmp_path_factory.mktemp("image-llava") / "tiny-llava", IMAGE_LLAVA_DIR)
    services, cluster, skipped = compose_stack(tmp_path, llava, profiles=("multimodal",))
    assert "encoder" in {s.name for s in services} and not skipped
    stack = LocalStack(services, tmp_path)
    try:
        stack.start()
        base = f"http://127.0.0.1:{cluster['router']['port']}"
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        buf = io.BytesIO()
        Image.new("RGB", (20, 20), (10, 200, 40)).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        resp = client.chat.completions.create(
            model=cluster["served_model_name"],
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "Hi"},
                    ],
                }
            ],
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 4
        (enc,) = [n for n in cluster["nodes"] if n["name"] == "encoder-0"]
        text = httpx.get(f"http://127.0.0.1:{enc['metrics_port']}/metrics").text
        m = re.search(r"pdserve:encoder_images_encoded_total ([0-9.]+)", text)
        assert m and float(m.group(1)) == 1.0
    except BaseException:
        print(stack.logs())
        raise
    finally:
        codes = stack.stop()
    assert codes == {s.name: 0 for s in services}, f"exit codes {codes}\n{stack.logs()}"

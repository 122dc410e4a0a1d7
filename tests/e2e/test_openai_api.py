"""The OpenAI API on a real Ray Serve app (CPU): the official SDK, the handle API, concurrency,
metrics. One app for the whole module."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tandem.deploy.observability.metrics import EXPORTED_PREFIX, METRIC_NAMES
from tandem.deploy.observability.replica_metrics import REPLICA_METRIC_NAMES

PROMPT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "Tell me about foxes."}]


@pytest.fixture(scope="module")
def app(serve_app_context, tiny_model_dir) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    model = str(tiny_model_dir("qwen3"))
    args = {
        "model": model,
        "served_model_name": "tiny-e2e",
        "device": "cpu",
        "engine": {"page_size": 4},
        "max_ongoing_requests": 16,
        "max_queued_requests": 64,
    }
    with serve_app_context(args) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Any:  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))


@pytest.fixture(scope="module")
def client(app: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def greedy_text(client: openai.OpenAI, app: Any) -> str:
    out = client.completions.create(model=app.served_model_name, prompt=PROMPT, max_tokens=24, temperature=0)
    return out.choices[0].text


def aclient(app: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{app.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_sync_completion_usage_and_logprobs(client: openai.OpenAI, app: Any, tokenizer: Any) -> None:
    out = client.completions.create(
        model=app.served_model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert out.usage.completion_tokens == len(choice.logprobs.tokens) >= 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert choice.logprobs.top_logprobs is not None
    # A dict by token string: byte tokens that each decode to U+FFFD collapse, so >= 1, not == 2.
    assert len(choice.logprobs.top_logprobs) == len(choice.logprobs.tokens)
    assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert choice.finish_reason in ("stop", "length")


def test_vllms_routes(client: openai.OpenAI, app: Any, tokenizer: Any) -> None:
    """vLLM's routes on the real app: the SDK's `models.retrieve`, /tokenize counting what a completion
    counts, /detokenize, /tokenizer_info, /version, /ping and a CORS preflight (any origin by default)."""
    card = client.models.retrieve(app.served_model_name)
    max_model_len = card.model_dump()["max_model_len"]  # vLLM's field, beyond the SDK's Model
    assert card.id == app.served_model_name and max_model_len > 0
    assert [m.model_dump()["max_model_len"] for m in client.models.list().data] == [max_model_len]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    tokenized = httpx.post(f"{app.base_url}/tokenize", json={"prompt": PROMPT}).json()
    usage = client.completions.create(model=app.served_model_name, prompt=PROMPT, max_tokens=1).usage
    assert usage is not None and tokenized["count"] == usage.prompt_tokens == len(tokenized["tokens"])
    assert tokenized["tokens"] == tokenizer.encode(PROMPT) and tokenized["max_model_len"] == max_model_len
    chat = httpx.post(f"{app.base_url}/tokenize", json={"messages": CHAT}).json()
    reply = client.chat.completions.create(model=app.served_model_name, messages=CHAT, max_tokens=1)
    assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens
    text = httpx.post(f"{app.base_url}/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(tokenized["tokens"])
    assert httpx.get(f"{app.base_url}/tokenizer_info").json()["eos_token"] == tokenizer.eos_token
    assert httpx.get(f"{app.base_url}/version").json()["version"]
    assert httpx.get(f"{app.base_url}/ping").status_code == 200
    preflight = httpx.options(
        f"{app.base_url}/v1/chat/completions",
        headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"


def test_sync_chat_stream_matches_non_stream(client: openai.OpenAI, app: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": app.served_model_name,
        "messages": CHAT,
        "max_tokens": 12,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert full.usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens > len(CHAT[0]["content"]) // 10
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_async_completion_stream_and_chat(app: Any) -> None:
    async def run() -> tuple[str, str, Any, Any]:
        client = aclient(app)
        streamed = ""
        stream = await client.completions.create(
            model=app.served_model_name, prompt=PROMPT, max_tokens=10, temperature=0, stream=True
        )
        async for chunk in stream:
            streamed += chunk.choices[0].text
        full = await client.completions.create(
            model=app.served_model_name, prompt=PROMPT, max_tokens=10, temperature=0
        )
        chat = await client.chat.completions.create(model=app.served_model_name, messages=CHAT, max_tokens=6)
        await client.close()
        return streamed, full.choices[0].text, full, chat

    streamed, text, full, chat = asyncio.run(run())
    assert streamed == text
    assert full.usage.completion_tokens >= 1
    assert chat.choices[0].message.role == "assistant"
    assert 1 <= chat.usage.completion_tokens <= 6


def test_n_gives_distinct_indexed_choices(client: openai.OpenAI, app: Any) -> None:
    chat = client.chat.completions.create(
        model=app.served_model_name, messages=CHAT, max_tokens=8, n=2, seed=7, temperature=1.0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    tokens = chat.usage.completion_tokens if chat.usage else 0
    assert tokens >= 2
    completion = client.completions.create(
        model=app.served_model_name, prompt=PROMPT, max_tokens=4, n=2, seed=7
    )
    assert sorted(c.index for c in completion.choices) == [0, 1]
    again = client.completions.create(model=app.served_model_name, prompt=PROMPT, max_tokens=4, n=2, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in completion.choices]  # seeded: repeatable


def test_chat_logprobs(client: openai.OpenAI, app: Any) -> None:
    out = client.chat.completions.create(
        model=app.served_model_name, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and out.usage is not None
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_stop_string_ends_text_before_it(client: openai.OpenAI, app: Any, greedy_text: str) -> None:
    # A stop string from the middle of the greedy text, likely spanning a token boundary.
    start = next(
        i
        for i in range(3, len(greedy_text) - 3)
        if "\ufffd" not in greedy_text[i : i + 3] and greedy_text.find(greedy_text[i : i + 3]) == i
    )
    stop = greedy_text[start : start + 3]
    out = client.completions.create(
        model=app.served_model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == greedy_text[:start]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=app.served_model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == greedy_text[:start]


def test_handle_calls_return_what_http_returns(app: Any) -> None:
    body: dict[str, Any] = {
        "model": app.served_model_name,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
    }
    http = httpx.post(f"{app.base_url}/v1/completions", json=body, timeout=60).json()
    plain = app.handle.completions.remote(body).result(timeout_s=60)
    assert plain["choices"][0]["text"] == http["choices"][0]["text"]
    assert plain["usage"] == http["usage"]
    streamed = list(app.handle.options(stream=True).completions.remote({**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed) == http["choices"][0]["text"]

    chat: dict[str, Any] = {"messages": CHAT, "max_tokens": 10, "temperature": 0}
    http_chat = httpx.post(f"{app.base_url}/v1/chat/completions", json=chat, timeout=60).json()
    plain_chat = app.handle.chat_completions.remote(chat).result(timeout_s=60)
    assert plain_chat["choices"][0]["message"] == http_chat["choices"][0]["message"]
    chunks = list(app.handle.options(stream=True).chat_completions.remote({**chat, "stream": True}))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == http_chat["choices"][0]["message"]["content"]

    stats = app.handle.stats.remote().result(timeout_s=30)
    for key in ("kv_pages_total", "kv_pages_used", "kv_pages_cached", "num_running", "num_waiting"):
        assert key in stats
    assert stats["num_replicas"] == 1 and stats["kv_pages_total"] > 0


def test_sse_framing(app: Any) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1


def test_64_concurrent_streams_complete(app: Any) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.completions.create(
            model=app.served_model_name, prompt=f"{PROMPT} {i}", max_tokens=16, stream=True
        )
        finish = None
        async for chunk in stream:
            finish = chunk.choices[0].finish_reason or finish
        return finish

    async def run() -> list[str | None]:
        client = aclient(app)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    finishes = asyncio.run(run())
    assert len(finishes) == 64
    assert all(f in ("stop", "length") for f in finishes), finishes


def test_metrics_are_exported(client: openai.OpenAI, app: Any) -> None:
    long_prompt = PROMPT * 6  # sent twice, so the radix cache reports prefix hits
    for _ in range(2):
        client.completions.create(model=app.served_model_name, prompt=long_prompt, max_tokens=4)
    with pytest.raises(openai.BadRequestError):  # one 4xx outcome
        client.completions.create(model=app.served_model_name, prompt=PROMPT, max_tokens=1, top_p=2)
    wanted = {EXPORTED_PREFIX + name for name in METRIC_NAMES + REPLICA_METRIC_NAMES} | _dashboard_series()
    deadline, missing = time.monotonic() + 30.0, wanted
    while missing and time.monotonic() < deadline:
        url = f"http://127.0.0.1:{app.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        missing = {name for name in wanted if f"\n{name}" not in text and f"\n# TYPE {name} " not in text}
        if missing:
            time.sleep(1.0)
    assert not missing, f"not exported: {sorted(missing)}"
    # The same series on the API port, as vLLM and SGLang serve theirs.
    api = httpx.get(f"{app.base_url}/metrics", timeout=30)
    assert api.status_code == 200 and api.headers["content-type"].startswith("text/plain")
    on_api = {name for name in wanted if f"\n{name}" in "\n" + api.text or f"# TYPE {name} " in api.text}
    assert on_api == wanted, sorted(wanted - on_api)
    assert all(line.startswith(("ray_tandem_", "# HELP ray_tandem_", "# TYPE ray_tandem_"))
               for line in api.text.splitlines())  # fmt: skip


def _dashboard_series() -> set[str]:
    """Every `ray_tandem_*` series the Grafana dashboard queries (histograms as their `_bucket` series)."""
    dashboard = Path(__file__).parents[2] / "helm" / "tandem" / "dashboards" / "tandem.json"
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    series = {name for expr in exprs for name in re.findall(r"ray_tandem_[a-z_]+", expr)}
    assert len(series) >= 8, series
    return series


def test_cached_tokens_are_the_page_rounded_prefix_on_one_replica(client: openai.OpenAI, app: Any) -> None:
    """A repeated prompt reports its whole cached prefix: all but its last token, in whole pages (4)."""
    prompt = "Cached tokens probe: seven silver swans swim slowly southward under the winter sky."
    first = client.completions.create(model=app.served_model_name, prompt=prompt, max_tokens=2)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    length = first.usage.prompt_tokens
    stream = client.completions.create(
        model=app.served_model_name,
        prompt=prompt,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == length
    assert usage[0].prompt_tokens_details is not None
    assert usage[0].prompt_tokens_details.cached_tokens == (length - 1) // 4 * 4
    chat = [{"role": "user", "content": "Cached chat probe: amber owls hoot at the quiet harbour."}]
    replies = [
        client.chat.completions.create(model=app.served_model_name, messages=chat, max_tokens=2)  # type: ignore[arg-type]
        for _ in range(2)
    ]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]  # type: ignore[union-attr]
    chat_length = replies[0].usage.prompt_tokens  # type: ignore[union-attr]
    assert cached == [0, (chat_length - 1) // 4 * 4]


def test_echo_logprobs_for_lm_eval_equal_hf(app: Any, tiny_model_dir, tokenizer: Any) -> None:  # type: ignore[no-untyped-def]
    """lm-eval's loglikelihood request (token-id prompts, max_tokens 1, logprobs 1, echo) on the real
    engine: the prompt's logprobs are HF's log-softmax on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("Foxes are small")]
    body = {"model": app.served_model_name, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    response = httpx.post(f"{app.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"), attn_implementation="eager").eval()
    for choice in response.json()["choices"]:
        prompt = prompts[choice["index"]]
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(prompt) + 1
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
        want = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        assert got[1 : len(prompt)] == pytest.approx(want.tolist(), abs=1e-4)
        greedy = logits.argmax(-1)[:-1].tolist() == prompt[1:]
        tops = choice["logprobs"]["top_logprobs"][1 : len(prompt)]
        assert all(lp == max(top.values()) for lp, top in zip(got[1:], tops)) == greedy

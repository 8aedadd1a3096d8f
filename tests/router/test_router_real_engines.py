"""End to end: the official ``openai`` client through ``pdserve proxy`` in front of two real
prefillers and two real decoders (separate processes, tiny model, CPU, NIXL between them) gets the
same greedy output as from a single instance, streaming and not, and every instance is used."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz",
    "A recipe for bread needs flour, water, salt and yeast; the dough is kneaded until it is smooth",
    "In the morning the fishing boats leave the harbour and return in the evening with their catch",
    "The theory of evolution explains how species change over many generations through selection",
]
#: test name -> the session pool's instance it stands for
ROLES = {"single": "single", "p0": "p", "p1": "p2", "d0": "d_fail", "d1": "d_rec"}


@pytest.fixture(scope="module")
def cluster(server_pool):
    """The session's shared instances (two prefillers, two decoders, the oracle) and a proxy
    in front of the four."""
    pooled = server_pool.get(*ROLES.values())
    servers = {name: pooled[pool_name] for name, pool_name in ROLES.items()}
    proxy = server_pool.proxy("two-by-two", [ROLES["p0"], ROLES["p1"]],
                              [ROLES["d0"], ROLES["d1"]])
    return {"servers": servers, "proxy": proxy, "model": server_pool.model}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(c: openai.OpenAI, model: str, prompt: str, stream: bool) -> str:
    kwargs = dict(model=model, prompt=prompt, max_tokens=12, temperature=0.0)
    if not stream:
        return c.completions.create(**kwargs).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kwargs)
                   if ch.choices)


def chat(c: openai.OpenAI, model: str, prompt: str, stream: bool) -> str:
    kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=12,
                  temperature=0.0)
    if not stream:
        return c.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(ch.choices[0].delta.content or "" for ch in
                   c.chat.completions.create(stream=True, **kwargs) if ch.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_proxy_output_equals_single_instance(cluster, stream):
    model, servers = cluster["model"], cluster["servers"]
    single, via_proxy = client(servers["single"].url), client(cluster["proxy"].url)
    before = {name: servers[name].metrics() for name in ("p0", "p1", "d0", "d1")}
    for prompt in PROMPTS:
        expected = complete(single, model, prompt, stream)
        assert expected, "the single instance generated nothing"
        assert complete(via_proxy, model, prompt, stream) == expected, prompt
    for prompt in PROMPTS[:2]:
        assert chat(via_proxy, model, prompt, stream) == chat(single, model, prompt, stream)
    after = {name: servers[name].metrics() for name in before}

    def grew(name, metric):
        return after[name].get(metric, 0.0) - before[name].get(metric, 0.0)

    for p in ("p0", "p1"):  # each prefiller computed prompts and finished requests
        assert grew(p, "pdserve:prompt_tokens_computed_total") > 0, p
        assert grew(p, "pdserve:request_success_total") >= 3, p
    for d in ("d0", "d1"):  # each decoder got its prompt KV from a prefiller over NIXL
        assert grew(d, "pdserve:prompt_tokens_transferred_total") > 0, d
        assert grew(d, "pdserve:request_success_total") >= 3, d


def test_proxy_relays_engine_errors(cluster):
    via_proxy = client(cluster["proxy"].url)
    with pytest.raises(openai.BadRequestError) as e:
        via_proxy.completions.create(model=cluster["model"], prompt="x", max_tokens=12,
                                     temperature=-1.0)
    assert e.value.status_code == 400 and e.value.body is not None


def test_proxy_relays_the_400_of_a_field_pdserve_does_not_support(cluster):
    """Tool calling through the proxy: P refuses the body before prefilling it, and the client
    gets P's 400 naming the field (vLLM's error shape: ``code`` is the status)."""
    via_proxy = client(cluster["proxy"].url)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    def computed() -> dict[str, float]:
        return {n: cluster["servers"][n].metrics().get("pdserve:prompt_tokens_computed_total", 0.0)
                for n in ("p0", "p1")}

    before = computed()
    with pytest.raises(openai.BadRequestError) as e:
        via_proxy.chat.completions.create(model=cluster["model"], max_tokens=4, tools=[tool],
                                          messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400
    assert e.value.body["param"] == "tools" and e.value.body["code"] == 400, e.value.body
    assert "not supported" in e.value.body["message"]
    assert computed() == before  # nothing was prefilled

"""`serve run deploy/dspark.yaml` as shipped: SmolLM2-135M-Instruct from its installed GGUF file,
through real clients, equal to transformers' own GGUF loader.

One `serve run` for the module. The official ``openai`` client's chat answers (streamed and not)
equal transformers' greedy answers to the same chat prompts (real_model_fixtures); lm-eval's
``local-completions`` against the server gives the log-likelihoods its ``hf`` backend gives on
the folder ``dspark export`` writes from the same file.
"""

from __future__ import annotations

import pytest

from conftest import REPO
from gguf_fixtures import smollm2_path
from real_model_fixtures import CHAT_PROMPTS, MAX_TOKENS, smollm2_reference  # noqa: F401,F811 (a fixture)
from serve_fixtures import app_stats, start_serve, stop_serve

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import ray

    assert not ray.is_initialized(), "another test left Ray initialised in this process"
    run = start_serve(None, tmp_path_factory.mktemp("smollm2"), startup_timeout_s=900,
                      source=REPO / "deploy" / "dspark.yaml")
    try:
        yield run
    finally:
        stop_serve(run)


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_the_shipped_yaml_serves_smollm2_under_its_name(served, client):
    assert served.model == "smollm2-135m-instruct"
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]


def test_chat_answers_equal_transformers(served, client, smollm2_reference):
    ref = smollm2_reference
    for question, prompt, text, tokens in zip(CHAT_PROMPTS, ref.prompts, ref.texts, ref.outputs):
        r = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": question}],
                                           max_tokens=MAX_TOKENS, temperature=0)
        choice = r.choices[0]
        assert choice.message.content == text, question
        assert choice.finish_reason == ("stop" if tokens[-1] == ref.eos else "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(tokens))
    assert "Paris" in ref.texts[0]


def test_streamed_chat_answers_equal_transformers(served, client, smollm2_reference):
    ref = smollm2_reference
    for i in (0, 2, 5):
        stream = client.chat.completions.create(model=served.model, stream=True, max_tokens=MAX_TOKENS,
                                                temperature=0,
                                                messages=[{"role": "user", "content": CHAT_PROMPTS[i]}])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.texts[i]
    stats = app_stats(served)
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_lm_eval_local_completions_equals_its_hf_backend_on_the_exported_folder(served, tmp_path_factory):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from dspark_ray.export import export_gguf

    folder = export_gguf(smollm2_path(), tmp_path_factory.mktemp("export") / "smollm2", dtype="float32")
    pairs = [
        ("The capital of France is", " Paris."),
        ("Water boils at 100 degrees", " Celsius at sea level."),
        ("def add(a, b):\n    return", " a + b"),
        ("Question: What is 2 + 2?\nAnswer:", " 4"),
        ("Once upon a time, there was a", " dragon who lived in a cave."),
    ]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    served_lm = get_model("local-completions")(
        base_url=f"{served.base_url}/v1/completions", model=served.model, tokenizer_backend="huggingface",
        tokenizer=str(folder), max_length=2048, max_retries=1, timeout=300)
    hf_lm = get_model("hf")(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1)
    got = served_lm.loglikelihood(requests, disable_tqdm=True)
    want = hf_lm.loglikelihood(requests, disable_tqdm=True)
    for pair, (ll, greedy), (ref_ll, ref_greedy) in zip(pairs, got, want):
        assert ll == pytest.approx(ref_ll, abs=2e-3), pair
        assert greedy == ref_greedy, pair
    assert any(g for _, g in want) and not all(g for _, g in want)  # both kinds of continuation

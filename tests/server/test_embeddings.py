"""Embeddings (``--task embed``, ``LLM.embed``, ``/v1/embeddings``) against transformers' last
hidden states, pooled and normalised."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
import torch
import transformers
from engine_checks import assert_no_leak
from hf_gguf import hf_of_gguf
from server_process import running_server
from tiny_models import TINY_VOCAB, make_tiny_checkpoint, make_tiny_model, write_gguf

from conveyor import LLM
from conveyor.model.loader import default_model_path, load_config
from conveyor.sampling_params import PoolingParams, SamplingParams

TOLERANCE = 1e-4  # float32 both sides


def pooled(hidden: torch.Tensor, pooling: str, normalize: bool = True) -> torch.Tensor:
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, transformers.PreTrainedModel]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    return path, transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_llm_embed_matches_transformers_through_chunks_and_preemption(tiny, pooling):
    path, hf = tiny
    prompts = [[(31 * i + 7 * j) % 49000 + 50 for i in range(length)]
               for j, length in enumerate((70, 9, 1, 33, 64, 64))]
    # 16 tokens a step: prompts in chunks, several in a step
    llm = LLM(model=path, dtype="float32", kv_cache_dtype="float32", num_kv_blocks=12,
              max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, task="embed",
              pooling_type=pooling)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            hidden = hf(torch.tensor([prompt])).last_hidden_state[0]
        got = torch.tensor(out.outputs.embedding)  # vLLM's shape
        assert (got - pooled(hidden, pooling)).abs().max() < TOLERANCE
        assert out.finished and out.prompt_token_ids == prompt
    raw = llm.embed({"prompt_token_ids": prompts[1]}, PoolingParams(normalize=False),
                    use_tqdm=False)[0]
    with torch.no_grad():
        hidden = hf(torch.tensor([prompts[1]])).last_hidden_state[0]
    assert (torch.tensor(raw.outputs.embedding) - pooled(hidden, pooling, False)).abs().max() < 1e-3
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="embeds, it does not generate"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_the_models_own_pooling_is_read(tmp_path):
    """A sentence-transformers folder's Pooling module and a GGUF's pooling_type."""
    folder = make_tiny_checkpoint(tmp_path / "st", "llama")
    os.makedirs(os.path.join(folder, "1_Pooling"))
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type":
                    "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                    "sentence_transformers.models.Pooling"}], f)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, f)
    llm = LLM(model=folder, dtype="float32", kv_cache_dtype="float32", num_kv_blocks=16,
              max_model_len=64, task="embed")
    assert llm.engine.pooling_type == "mean"
    model = make_tiny_model("llama", vocab_size=len(TINY_VOCAB))
    for value, name in ((1, "mean"), (2, "cls"), (3, "last")):
        path = write_gguf(str(tmp_path / f"p{value}.gguf"), model, tokenizer=True,
                          metadata={"pooling_type": value})
        assert load_config(path).pooling_type == name


# -- the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with running_server("--task", "embed", "--dtype", "float32", "--kv-cache-dtype",
                        "float32") as proc:
        yield proc


def test_embeddings_match_transformers_last_token_pooled(client, model):
    hf, tokenizer = hf_of_gguf(default_model_path(), transformers.AutoModel)
    texts = ["Continuous batching admits requests at every step.", "A cat.", "Paged KV"]
    # the client asks for base64 unless told otherwise; both encodings carry the same vector
    response = client.embeddings.create(model=model, input=texts)
    floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
    assert [d.index for d in response.data] == [0, 1, 2]
    total = 0
    for text, got, also in zip(texts, response.data, floats.data):
        ids = tokenizer.encode(text, add_special_tokens=False)
        total += len(ids)
        with torch.no_grad():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]
        assert (torch.tensor(got.embedding) - pooled(hidden, "last")).abs().max() < 1e-3
        assert got.embedding == pytest.approx(also.embedding, abs=1e-7)
    assert response.usage.prompt_tokens == response.usage.total_tokens == total


def test_embedding_errors(server, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input=[])
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 400 and "embeds" in r.json()["error"]["message"], r.text


def test_score_rerank_and_pooling_are_cosines_of_the_embeddings(server, client, model):
    """vLLM's pooling routes on an embed server, against /v1/embeddings' own vectors."""
    query, docs = "Where is Paris?", ["Paris is in France.", "A cat sat.", "France's capital"]
    vectors = [torch.tensor(d.embedding) for d in client.embeddings.create(
        model=model, input=[query, *docs], encoding_format="float").data]
    want = [float(torch.nn.functional.cosine_similarity(vectors[0], v, dim=0))
            for v in vectors[1:]]
    url = server.base_url
    for path in ("/score", "/v1/score"):
        r = httpx.post(f"{url}{path}", json={"model": model, "text_1": query, "text_2": docs},
                       timeout=60).json()
        assert [d["index"] for d in r["data"]] == [0, 1, 2]
        assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)
    pairwise = httpx.post(f"{url}/score", json={"text_1": [query, query], "text_2": docs[:2]},
                          timeout=60).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(want[:2], abs=1e-5)
    uneven = httpx.post(f"{url}/score", json={"text_1": [query, query], "text_2": docs},
                        timeout=60)
    assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "text_1"
    for path in ("/rerank", "/v1/rerank"):
        r = httpx.post(f"{url}{path}", json={"query": query, "documents": docs, "top_n": 2},
                       timeout=60).json()
        best = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [x["index"] for x in r["results"]] == best
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx(
            [want[i] for i in best], abs=1e-5)
        assert r["results"][0]["document"]["text"] == docs[best[0]]
    pooled_out = httpx.post(f"{url}/pooling", json={"input": [query]}, timeout=60).json()
    assert pooled_out["data"][0]["data"] == pytest.approx(vectors[0].tolist(), abs=1e-6)
    classify = httpx.post(f"{url}/classify", json={"input": query}, timeout=60)
    assert classify.status_code == 400 and "no classification head" in classify.json()[
        "error"]["message"]

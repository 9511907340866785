"""The batched sampler: filters never let a disallowed token through; seeds are batch-independent.
Every test runs with the draw in PyTorch and with the CPU kernel's (where it builds)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.request import Request
from conveyor.kernels import isa
from conveyor.kernels.bindings import SampleRows
from conveyor.kernels.library import load_library
from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampler import Sampler

V = 50
EOS = 0


class SortingSampler(Sampler):
    MAX_ROUNDS = 0  # every top-p row is left to the sort that finishes the rare open row


@pytest.fixture(scope="module", params=["torch", "torch-sorted", "kernel"])
def make(request):
    """Sampler(vocab_size, seed) drawing in PyTorch (by rejection, or with every top-p row
    by the sort) or with the CPU kernel."""
    if request.param.startswith("torch"):
        kind = Sampler if request.param == "torch" else SortingSampler
        return lambda vocab, seed: kind(vocab, torch.device("cpu"), seed)
    lib = load_library(isa.current().tier)
    if lib is None:
        pytest.skip("the CPU kernels do not build here")
    return lambda vocab, seed: Sampler(vocab, torch.device("cpu"), seed, draw=SampleRows(lib))


def req(rid: str = "r", prompt=(1, 2, 3), outputs=(), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), frozenset([EOS]), 0.0)
    for t in outputs:
        r.append_output_token(t)
    return r


def allowed_set(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                min_p: float) -> set[int]:
    """The tokens the filters allow, computed independently of the sampler, one token at a time."""
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k > 0:
        order = order[:top_k]
    kept, mass = [], 0.0
    total = sum(probs[i] for i in order)
    for i in order:
        if kept and mass > top_p * total + 1e-6:
            break
        kept.append(i)
        mass += probs[i]
    if min_p > 0:
        top = max(probs[i] for i in kept) / sum(probs[i] for i in kept)
        kept_total = sum(probs[i] for i in kept)
        kept = [i for i in kept if probs[i] / kept_total >= min_p * top - 1e-6]
    return set(kept)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.floats(0.3, 2.0),
       top_k=st.sampled_from([0, 1, 2, 5, 20]), top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
       min_p=st.sampled_from([0.0, 0.05, 0.3]), vocab=st.sampled_from([V, 3000]),
       scale=st.sampled_from([0.3, 3.0, 10.0]))
def test_filters_never_emit_a_token_outside_the_allowed_set(make, seed, temperature, top_k, top_p,
                                                            min_p, vocab, scale):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * scale
    allowed = allowed_set(logits, temperature, top_k, top_p, min_p)
    sampler = make(vocab, seed)
    batch = [req(str(i), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
             for i in range(32)]
    seen = set()
    for _ in range(8):
        seen |= {r.token_id for r in sampler(logits.expand(32, vocab).clone(), batch)}
    assert seen <= allowed, f"sampled {seen - allowed} outside {allowed}"


def test_top_p_keeps_the_smallest_set_reaching_p(make):
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log().expand(200, 5).clone()
    sampler = make(5, 0)
    out = sampler(logits, [req(str(i), top_p=0.7) for i in range(200)])
    tokens = {r.token_id for r in out}
    assert tokens == {0, 1}  # 0.5 < 0.7, so the 0.3 token is needed too; nothing more


def test_a_top_k_past_the_vocabulary_keeps_every_token(make):
    """(a top_k of 2**63 or more, which the API takes, must not overflow a kernel's int64)"""
    logits = torch.zeros(400, V)
    out = make(V, 0)(logits, [req(str(i), temperature=1.0, top_k=2**70) for i in range(400)])
    assert len({r.token_id for r in out}) > V // 2


def test_greedy_is_argmax_and_temperature_zero_ignores_filters(make):
    logits = torch.randn(4, V)
    out = make(V, 0)(logits, [req(str(i), temperature=0, top_k=3)
                                                     for i in range(4)])
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()


def test_seeded_request_is_independent_of_the_batch(make):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(V, generator=gen)

    def run(batch_size: int) -> list[int]:
        sampler = make(V, batch_size)  # different global noise
        seeded = req("seeded", temperature=1.0, seed=1234)
        others = [req(f"o{i}", temperature=1.0) for i in range(batch_size - 1)]
        tokens = []
        for _ in range(20):
            rows = others + [seeded]
            out = sampler(logits.expand(len(rows), V).clone(), rows)
            tokens.append(out[-1].token_id)
        return tokens

    alone = run(1)
    assert alone == run(7) == run(16)
    assert len(set(alone)) > 1  # it really sampled


def test_penalties_push_away_from_seen_tokens(make):
    logits = torch.zeros(1, V)
    logits[0, 7] = 2.0
    logits[0, 8] = 1.5
    sampler = make(V, 0)
    assert sampler(logits, [req(temperature=0)])[0].token_id == 7
    assert sampler(logits, [req(prompt=[7], temperature=0, repetition_penalty=2.0)])[0].token_id == 8
    assert sampler(logits, [req(outputs=[7], temperature=0, frequency_penalty=1.0)])[0].token_id == 8
    assert sampler(logits, [req(outputs=[7], temperature=0, presence_penalty=0.4)])[0].token_id == 7
    assert sampler(logits, [req(outputs=[7], temperature=0, presence_penalty=0.6)])[0].token_id == 8


def test_logit_bias_is_added_per_row_before_the_draw(make):
    """OpenAI's logit_bias: -100 bans a token, +100 all but forces one, in a batch whose other
    rows have none; greedy and sampled alike."""
    logits = torch.zeros(3, V)
    logits[:, 7] = 5.0
    sampler = make(V, 0)
    rows = [req("ban", temperature=0, logit_bias={7: -100.0, 8: 1.0}),
            req("plain", temperature=0),
            req("force", temperature=1.0, logit_bias={11: 100.0})]
    assert [r.token_id for r in sampler(logits, rows)] == [8, 7, 11]
    assert torch.equal(logits[:, 7], torch.full((3,), 5.0))  # the caller's logits untouched
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={7: 101.0})


def test_min_tokens_masks_eos_and_stop_ids(make):
    logits = torch.zeros(1, V)
    logits[0, EOS] = 5.0
    logits[0, 9] = 4.0
    logits[0, 3] = 3.0
    sampler = make(V, 0)
    early = req(temperature=0, min_tokens=2, stop_token_ids=[9])
    assert sampler(logits, [early])[0].token_id == 3
    late = req(outputs=[5, 5], temperature=0, min_tokens=2, stop_token_ids=[9])
    assert sampler(logits, [late])[0].token_id == EOS


def test_logprobs_are_raw_log_softmax_with_ranks(make):
    logits = torch.randn(1, V)
    out = make(V, 0)(logits, [req(temperature=0, logprobs=3)])[0]
    expected = torch.log_softmax(logits[0], -1)
    (tok, lp, rank), *top = out.logprobs
    assert tok == int(logits.argmax()) and rank == 1 and math.isclose(lp, float(expected[tok]),
                                                                      rel_tol=1e-5)
    assert [t for t, _, _ in top] == expected.topk(3).indices.tolist()
    assert [r for _, _, r in top] == [1, 2, 3]


def nucleus_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                         min_p: float) -> torch.Tensor:
    """The exact distribution the filters leave (float64, renormalised), computed apart from the
    sampler: top_k, then top_p over those, then min_p."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    kept_mass = sum(probs[i] for i in order)
    nucleus, before = [], 0.0
    for i in order:
        if nucleus and before > top_p * kept_mass:
            break
        nucleus.append(i)
        before += float(probs[i])
    out = torch.zeros_like(probs)
    top = float(probs[nucleus[0]])
    for i in nucleus:
        if probs[i] >= min_p * top:
            out[i] = probs[i]
    return out / out.sum()


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of counts against expected counts (cells under 5 pooled): the chance of
    a statistic at least this large if the counts were drawn from the expected distribution."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().unsqueeze(0)])
    exp = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,vocab,scale", [
    (1.0, 0, 1.0, 0.0, V, 1.0), (0.7, 0, 1.0, 0.0, V, 1.0), (1.0, 5, 1.0, 0.0, V, 1.0),
    (1.0, 0, 0.8, 0.0, V, 1.0), (1.0, 0, 0.3, 0.0, V, 1.0), (1.3, 0, 1.0, 0.1, V, 1.0),
    (0.8, 10, 0.9, 0.05, V, 1.0), (1.0, 40, 0.95, 0.0, V, 1.0),
    # a vocabulary's worth of tokens, peaked (a model's logits) and nearly flat
    (0.8, 0, 0.95, 0.0, 4096, 4.0), (1.0, 0, 1.0, 0.05, 4096, 4.0), (0.8, 40, 0.9, 0.0, 4096, 4.0),
    (1.0, 0, 0.5, 0.0, 4096, 0.3)])
def test_sampled_frequencies_follow_the_renormalised_distribution(make, temperature, top_k, top_p,
                                                                 min_p, vocab, scale):
    """20,000 draws a setting against the exact distribution the rules leave: a chi-square test
    at 0.001 (the seeds are fixed, so the test is deterministic), nothing outside the allowed
    tokens, and the same counts fail against the unfiltered distribution where the rules cut
    something (the test can tell them apart)."""
    gen = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logits = torch.randn(vocab, generator=gen) * scale
    want = nucleus_distribution(logits, temperature, top_k, top_p, min_p)
    assert (want > 0).sum() >= 3  # a distribution to test
    sampler = make(vocab, 7)
    batch = [req(str(i), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
             for i in range(2000)]
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(10):
        for r in sampler(logits.expand(len(batch), vocab).clone(), batch):
            counts[r.token_id] += 1
    assert counts[want == 0].sum() == 0
    assert chi_square_p_value(counts, want * counts.sum()) > 1e-3
    unfiltered = torch.softmax(logits.double() / temperature, -1)
    if (want == 0).any():
        assert chi_square_p_value(counts, unfiltered * counts.sum()) < 1e-6


def test_penalties_and_a_grammar_mask_come_before_the_draw(make):
    """The draw is from the penalised logits, restricted to the grammar's tokens."""
    from conveyor.worker.sampler import GrammarMask

    logits = torch.randn(V, generator=torch.Generator().manual_seed(5))
    allowed = [3, 4, 7, 11, 20]
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    sampler = make(V, 1)
    batch = [req(str(i), outputs=[7], temperature=1.0, presence_penalty=1.5) for i in range(2000)]
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(10):
        mask = GrammarMask(list(range(len(batch))), bitmask.expand(len(batch), 2).clone())
        for r in sampler(logits.expand(len(batch), V).clone(), batch, mask):
            counts[r.token_id] += 1
    penalised = logits.double().clone()
    penalised[7] -= 1.5
    want = torch.zeros(V, dtype=torch.float64)
    want[allowed] = torch.softmax(penalised[allowed], -1)
    assert counts[want == 0].sum() == 0
    assert chi_square_p_value(counts, want * counts.sum()) > 1e-3


def test_a_gpu_step_reads_nothing_back_before_its_one_transfer():
    """The draw as on a GPU, on fake tensors (FakeTensorMode: shapes, no data), where any op
    that needs a value on the host (a sync on a GPU: .item(), bool(), .tolist(), nonzero, a
    boolean index) raises: every rule at once, a top-p row drawn in rounds, a seeded row, a
    grammar."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from conveyor.worker.sampler import GrammarMask

    sampler = Sampler(V, torch.device("cpu"), 3)
    sampler.host_reads_free = False  # as on a GPU
    batch = [req("greedy", temperature=0),
             req("nucleus", outputs=[5], temperature=0.8, top_p=0.9, top_k=20, min_p=0.05,
                 seed=4, presence_penalty=0.5, repetition_penalty=1.2, logprobs=2),
             req("early", min_tokens=2, temperature=1.0, logit_bias={3: 2.0})]
    with FakeTensorMode():
        logits = torch.randn(3, V)
        grammar = GrammarMask([1], torch.zeros(1, 2, dtype=torch.int32))
        tokens, finite, still_open, _, _ = sampler._draw(logits, batch, grammar)
    assert tokens.shape == finite.shape == still_open.shape == (3,)

"""FlexAttention over the paged cache (the GPU path) against attention written out per query:
block tables with shared (prefix) pages, windows, soft caps, GQA; and its BlockMask lists every
page a query reads, so the fused kernel, which visits only the listed pages, loses none."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from conveyor.model.flex_attention import Q_BLOCK, FlexPages

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
BS, PAGES, KV_HEADS, HEADS, DIM = 4, 12, 2, 4, 8


@st.composite
def steps(draw):
    """Sequences with tables drawn from the pool (some pages shared, as prefix hits are), and
    queries at positions each sequence's pages hold."""
    tables, queries = [], []
    for s in range(draw(st.integers(1, 4))):
        pages = draw(st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=3, unique=True))
        tables.append(pages)
        length = draw(st.integers(1, len(pages) * BS))
        first = draw(st.integers(0, length - 1))
        queries += [(s, p) for p in range(first, length)]
    width = max(len(t) for t in tables)
    return [t + [-1] * (width - len(t)) for t in tables], queries


def reference(q, k_cache, v_cache, tables, queries, window, softcap):
    out = []
    for t, (s, pos) in enumerate(queries):
        pages = [p for p in tables[s] if p >= 0]
        k = k_cache[pages].reshape(-1, KV_HEADS, DIM)[:pos + 1]
        v = v_cache[pages].reshape(-1, KV_HEADS, DIM)[:pos + 1]
        if window is not None:
            k, v = k[-window:], v[-window:]
        k = k.repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("hd,khd->hk", q[t], k) * DIM ** -0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def flex_pages(tables, queries) -> FlexPages:
    return FlexPages(torch.tensor([p for _, p in queries], dtype=torch.int32),
                     torch.tensor([s for s, _ in queries], dtype=torch.int32),
                     torch.tensor(tables, dtype=torch.int32), BS, PAGES)


@settings(max_examples=40, deadline=None)
@given(steps(), st.sampled_from([None, 1, 5]), st.sampled_from([None, 3.0]))
def test_flex_pages_attend_as_each_query_through_its_table(step, window, softcap):
    tables, queries = step
    torch.manual_seed(len(queries))
    k_cache, v_cache = (torch.randn(PAGES, BS, KV_HEADS, DIM) for _ in range(2))
    q = torch.randn(len(queries), HEADS, DIM)
    out = flex_pages(tables, queries).attend(q, k_cache, v_cache, None, window, softcap)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, queries, window,
                                              softcap))


@settings(max_examples=40, deadline=None)
@given(steps(), st.sampled_from([None, 2]))
def test_block_mask_lists_every_page_a_query_reads(step, window):
    tables, queries = step
    block_mask = flex_pages(tables, queries).block_mask(window)
    listed = block_mask.to_dense()[0, 0].bool()   # [query blocks, pages]
    for t, (s, pos) in enumerate(queries):
        pages = [p for p in tables[s] if p >= 0]
        first = 0 if window is None else max(0, pos - window + 1)
        read = {pages[i // BS] for i in range(first, pos + 1)}
        assert all(listed[t // Q_BLOCK, p] for p in read)
    # and no block lists a page none of its queries' tables hold
    for b in range(listed.shape[0]):
        held = {p for s, _ in queries[b * Q_BLOCK:(b + 1) * Q_BLOCK] for p in tables[s] if p >= 0}
        assert set(listed[b].nonzero().flatten().tolist()) == held


@pytest.mark.slow
def test_the_compiled_kernel_visits_the_listed_pages_only_and_agrees():
    """The fused kernel (inductor's, compiled on this CPU: the unfused path reads every slot)
    skips the pages a block does not list; the result is the same. A later step's mask (new
    tables, a new mask_mod closure) of the same shapes reuses the compiled kernel."""
    from torch._dynamo.utils import counters
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if not pick_vec_isa():
        pytest.skip("inductor's CPU FlexAttention template calls at::vec helpers that ATen's "
                    "scalar build lacks (ATEN_CPU_CAPABILITY=default, which "
                    "CONVEYOR_CPU_ISA=generic sets): it does not compile")

    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(PAGES, BS, KV_HEADS, DIM) for _ in range(2))
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    counters.clear()
    for tables in ([[3, 7, -1], [5, -1, -1], [0, 3, 9]], [[1, 2, -1], [11, -1, -1], [4, 1, 6]]):
        queries = [(0, 6), (1, 2), (2, 9), (2, 10), (2, 11)] + [(0, 7)] * 14
        q = torch.randn(len(queries), HEADS, DIM)
        out = compiled(q.transpose(0, 1).unsqueeze(0),
                       k_cache.view(1, -1, KV_HEADS, DIM).transpose(1, 2),
                       v_cache.view(1, -1, KV_HEADS, DIM).transpose(1, 2),
                       block_mask=flex_pages(tables, queries).block_mask(None), enable_gqa=True)
        torch.testing.assert_close(out.squeeze(0).transpose(0, 1),
                                   reference(q, k_cache, v_cache, tables, queries, None, None))
    assert counters["stats"]["unique_graphs"] == 1

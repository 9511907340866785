"""Batched sampling: every rule is a tensor operation over the whole batch, never a Python loop
over the vocabulary. Requests with a seed draw their noise from their own generator, so their
tokens do not depend on what else is in the batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.core.request import Request
from conveyor.sampling_params import SamplingParams

# (logits [R, V], temperature, top_k, top_p, min_p, uniform: one a row) -> tokens [R]
Draw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor], torch.Tensor]
_NEG_INF = float("-inf")


@dataclass
class SampleResult:
    token_id: int
    # (token id, logprob, rank) of the sampled token first, then the top-k; None if not asked
    logprobs: list[tuple[int, float, int]] | None = None
    error: str | None = None  # this row failed: its request ends with this error, alone


def first_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, as ``argmax(dim=-1)``, which is slower on the CPU."""
    return x.max(dim=-1).indices


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [R, V] from an int32 token bitmask [R, ceil(V / 32)] (bit j of word w: token
    32w + j), as llguidance and xgrammar lay it out."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


@dataclass
class GrammarMask:
    """The allowed tokens of a step's constrained rows: ``rows[i]``'s are ``bitmask[i]``."""

    rows: list[int]
    bitmask: torch.Tensor


def ranked_logprobs(logprobs: torch.Tensor, tokens: list[int], ks: list[int]
                    ) -> list[list[tuple[int, float, int]]]:
    """Per row: (token, logprob, rank) of its token, then of its top ``ks[i]``: one pass over
    the rows (the sampled tokens' logprobs, and the prompt's)."""
    index = torch.tensor(tokens, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, index)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(max(ks, default=0), dim=1)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [[(tok, lp, rank)] + [(t, v, j + 1) for j, (t, v) in
                                 enumerate(zip(top_ids[i][:k], top_vals[i][:k]))]
            for i, (tok, lp, rank, k) in enumerate(zip(tokens, chosen.flatten().tolist(),
                                                       ranks, ks))]


def _add_logit_biases(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's logit_bias added to its logits (one scatter for the batch); the logits as
    they are where no row has one."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype,
                                                device=logits.device), accumulate=True)


class Sampler:
    MAX_ROUNDS = 8  # rejection rounds of top-p sampling before the open rows are sorted

    def __init__(self, vocab_size: int, device: torch.device, seed: int,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = first_max,
                 draw: Draw | None = None) -> None:
        """argmax: each row's first maximum of float32 [B, V] (the CPU kernel, where built);
        draw: the sampled rows' tokens from one uniform a row (the CPU kernel, where built),
        else drawn here in PyTorch."""
        self.argmax = argmax
        self.draw = draw
        self.vocab_size = vocab_size
        self.device = device
        # reading a value back costs no sync (the CPU): the rounds may stop early
        self.host_reads_free = device.type == "cpu"
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._request_generators.pop(rid, None)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._request_generators[request.request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 grammar: GrammarMask | None = None) -> list[SampleResult]:
        """logits: [B, V] float32, one row per request, in the same order. A row that is not
        finite (NaN or inf from the model) or fails is that request's error, not the batch's.
        ``grammar``: structured outputs' allowed tokens, applied before any other rule.

        Every rule runs on the logits' device, and the tokens come back in one transfer: on a
        GPU one host sync a step, and a second in the rare step where a top-p row is still
        open after MAX_ROUNDS (``_draw``)."""
        tokens, finite, still_open, logits, raw = self._draw(logits, requests, grammar)
        token_list, finite_list, open_list = torch.stack(
            (tokens, finite.long(), still_open.long())).tolist()
        reopened = [i for i, is_open in enumerate(open_list) if is_open]
        if reopened:  # (rare) the nucleus by a sort
            for i, token in zip(reopened, self._sorted_nucleus(
                    logits[reopened], [requests[i] for i in reopened]).tolist()):
                token_list[i] = token
        results = [SampleResult(tok) for tok in token_list]
        want_logprobs = [r.sampling_params.logprobs for r in requests]
        asked = [i for i, k in enumerate(want_logprobs) if k is not None]
        if asked:  # the model's logprobs, before any rule
            rows = torch.tensor(asked, device=logits.device)
            for i, entries in zip(asked, ranked_logprobs(
                    torch.log_softmax(raw[rows], dim=-1), [token_list[i] for i in asked],
                    [want_logprobs[i] for i in asked])):
                results[i].logprobs = entries
        for i, ok in enumerate(finite_list):
            if not ok:
                results[i] = SampleResult(0, error="the model produced non-finite logits (NaN "
                                                   "or inf) for this request")
        return results

    def _draw(self, logits: torch.Tensor, requests: list[Request],
              grammar: GrammarMask | None) -> tuple[torch.Tensor, ...]:
        """Each row's token (greedy or drawn), whether its logits are finite, whether its top-p
        draw is still open, the logits after the rules and before them: device tensors, made
        without reading any value back to the host (on a GPU, without a sync)."""
        finite = torch.isfinite(logits.sum(dim=-1))
        if self.draw is not None and not bool(finite.all()):
            # The CPU kernels take finite rows (and on the CPU reading the flag costs nothing);
            # PyTorch's rules take any row, its token discarded.
            logits = logits.masked_fill(~finite.unsqueeze(1), 0.0)
        params = [r.sampling_params for r in requests]
        raw = logits  # logprobs are the model's, before any rule below

        # The caller's logits are left as they are: edits below make new tensors.
        logits = _add_logit_biases(logits, params)
        if grammar is not None:
            logits = logits.clone()
            rows = torch.tensor(grammar.rows, device=logits.device)
            logits[rows] = logits[rows].masked_fill(
                ~allowed_tokens(grammar.bitmask, logits.shape[1]), _NEG_INF)
        logits = self._mask_early_stops(logits, requests)
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits, requests)

        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == len(requests):  # every row drawn: no copy of the rows, no argmax
            tokens, still_open = self._sample(logits, requests)
        else:
            tokens = self.argmax(logits)
            still_open = torch.zeros_like(finite)
            if sampled:
                tokens[sampled], still_open[sampled] = self._sample(
                    logits[sampled], [requests[i] for i in sampled])
        return tokens, finite, still_open, logits, raw

    def _mask_early_stops(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Before min_tokens, EOS and stop token ids cannot be sampled."""
        rows, cols = [], []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                rows += [i] * len(stops)
                cols += sorted(stops)
        if rows:
            logits = logits.clone()
            logits[rows, cols] = _NEG_INF
        return logits

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        B, V = logits.shape
        dev = logits.device

        def padded(seqs: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(s) for s in seqs))
            return torch.tensor([s + [V] * (width - len(s)) for s in seqs], device=dev)

        out_ids = padded([r.output_token_ids for r in requests])
        counts = torch.zeros(B, V + 1, device=dev).scatter_add_(
            1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))[:, :V]
        prompt_ids = padded([r.prompt_token_ids for r in requests])
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=dev).scatter_(1, prompt_ids, True)
        seen = seen[:, :V] | (counts > 0)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(r.sampling_params, name) for r in requests],
                                dtype=torch.float32, device=dev).unsqueeze(1)

        rep = column("repetition_penalty")
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        return (torch.where(seen, penalised, logits) - column("frequency_penalty") * counts
                - column("presence_penalty") * (counts > 0).float())

    def _uniforms(self, requests: list[Request], rounds: int = 1) -> torch.Tensor:
        """[rows, rounds] uniforms in [0, 1): a seeded request's from its own generator (so its
        draws do not depend on the batch, nor on how many rounds its batch needed), the
        others' from the engine's."""
        u = torch.rand(len(requests), rounds, generator=self.generator, device=self.device)
        for i, r in enumerate(requests):
            gen = self._generator(r)
            if gen is not None:
                u[i] = torch.rand(rounds, generator=gen, device=self.device)
        return u

    def _rules(self, logits: torch.Tensor, params: list[SamplingParams]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """softmax(logits / temperature) over each row's top_k tokens (probs), those of them at
        least min_p times as likely as the most likely (allowed: the probs, others 0), and
        each row's top_p."""
        B, V = logits.shape
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        logits = logits / temps.unsqueeze(1)
        top_k = [min(p.top_k, V) if p.top_k > 0 else V for p in params]
        if any(k < V for k in top_k):  # each row's k largest stay (ties as topk breaks them)
            indices = logits.topk(max(k for k in top_k if k < V), dim=-1).indices
            keep = torch.arange(indices.shape[1], device=dev) < torch.tensor(
                top_k, device=dev).unsqueeze(1)
            kept = torch.zeros(B, V, dtype=torch.bool, device=dev).scatter_(1, indices, keep)
            kept |= torch.tensor([k == V for k in top_k], device=dev).unsqueeze(1)
            logits = logits.masked_fill(~kept, _NEG_INF)
        probs = logits.softmax(dim=-1)
        allowed = probs
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            allowed = probs.masked_fill(probs < floor, 0.0)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        return probs, allowed, top_p

    def _sample(self, logits: torch.Tensor, requests: list[Request]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token a row from the ``_rules``' allowed tokens restricted to the top_p nucleus
        (the fewest most likely whose mass reaches top_p), renormalised; and which rows are
        still open (none, but for the rare row after MAX_ROUNDS: ``_sorted_nucleus``). With
        ``draw`` (the CPU kernel) that is all done there, from one uniform a row.

        Here, no row is sorted: the nucleus is found by rejection (as FlashInfer samples top-p):
        draw from the tokens allowed so far (one uniform a row, inverse CDF), accept if the mass
        of the tokens more likely than the draw is at most top_p, else no token as unlikely as
        it can be in the nucleus, so the next draw is from the more likely ones only. Accepted
        draws are distributed exactly as the nucleus renormalised; a few rounds end it (each
        rejection removes the draw and everything below it). On a GPU every row takes part in
        every round (an accepted one keeps its token), so no round needs the host; on the CPU,
        where asking costs nothing, a round takes the open rows only, and the rounds stop once
        every row is accepted."""
        params = [r.sampling_params for r in requests]
        B, V = logits.shape
        dev = logits.device
        if self.draw is not None:
            temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
            return self.draw(
                logits, temps, torch.tensor([min(max(p.top_k, 0), V) for p in params]),
                torch.tensor([p.top_p for p in params], dtype=torch.float32),
                torch.tensor([p.min_p for p in params], dtype=torch.float32),
                self._uniforms(requests)[:, 0].double()), torch.zeros(B, dtype=torch.bool)
        probs, allowed, top_p = self._rules(logits, params)
        rounds = 1 if all(p.top_p >= 1 for p in params) else self.MAX_ROUNDS
        u = self._uniforms(requests, rounds)
        tokens = torch.zeros(B, dtype=torch.long, device=dev)
        still_open = torch.ones(B, dtype=torch.bool, device=dev)
        low = torch.full((B,), -1.0, device=dev)  # each row draws from probs > low
        for r in range(rounds):
            # the open rows: on the CPU just those (reading which is free), on a GPU all
            rows = still_open.nonzero().squeeze(1) if self.host_reads_free else slice(None)
            if self.host_reads_free and len(rows) == 0:
                break
            p, is_open = probs[rows], still_open[rows]
            candidates = allowed[rows].masked_fill(p <= low[rows].unsqueeze(1), 0.0)
            drawn = _inverse_cdf(candidates, u[rows, r])
            p_drawn = p.gather(1, drawn.unsqueeze(1)).squeeze(1)
            above = p.masked_fill(p <= p_drawn.unsqueeze(1), 0.0).sum(-1)
            accept = is_open & ((above <= top_p[rows]) | (top_p[rows] >= 1))
            tokens[rows] = torch.where(accept, drawn, tokens[rows])
            low[rows] = torch.where(is_open & ~accept, p_drawn, low[rows])
            still_open[rows] = is_open & ~accept
        return tokens, still_open

    def _sorted_nucleus(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The rows' tokens from their top_p nucleus found by sorting (``_sample``'s rare
        remainder)."""
        probs, allowed, top_p = self._rules(logits, [r.sampling_params for r in requests])
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = (ordered.cumsum(dim=-1) - ordered) > top_p.unsqueeze(1)
        outside[:, 0] = False  # the most likely token is always in
        nucleus = allowed.masked_fill(torch.zeros_like(outside).scatter_(1, order, outside), 0.0)
        return _inverse_cdf(nucleus, self._uniforms(requests)[:, 0])


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's index drawn with probability proportional to its weight (>= 0, some > 0):
    the first whose running sum passes u times the row's total; never a zero weight."""
    cdf = weights.cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # u * total can round up to the total: the last token of positive weight then
    last = (weights > 0).cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(drawn, last)

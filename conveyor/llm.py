"""Offline inference in vLLM's shape: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from conveyor.config import EngineConfig
from conveyor.engine.engine import LLMEngine
from conveyor.engine.input_processor import Prompt
from conveyor.logs import show_progress
from conveyor.outputs import EmbeddingRequestOutput, RequestOutput
from conveyor.sampling_params import PoolingParams, SamplingParams

Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, **settings: Any) -> None:
        """``settings``: ``EngineConfig``'s fields (its flags, in Python's spelling)."""
        config = EngineConfig(model=model, **settings)
        show_progress()
        if config.data_parallel_size != 1:
            raise ValueError("data-parallel replicas run behind the server: "
                             "conveyor serve --data-parallel-size N")
        self.engine = LLMEngine(config)
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def embed(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (``.outputs.embedding``, as vLLM's), under
        ``task="embed"``: its last hidden states pooled (``pooling_type``), normalised unless
        ``pooling_params`` says not."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else prompts
        return [EmbeddingRequestOutput.of(out) for out in self.generate(
            prompts, [pooling_params or PoolingParams()] * len(prompts), use_tqdm)]

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams | PoolingParams]
                 | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order.

        ``priority`` (one per prompt, lower first) matters under ``scheduling_policy="priority"``."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:  # the model's defaults (--generation-config), as vLLM's
            sampling_params = SamplingParams(**self.engine.sampling_defaults)
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for "
                             f"{len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else priority
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        # Validate everything before queueing anything, so a bad prompt loses no work.
        for prompt, params in zip(prompts, sampling_params):
            self.engine.check_request(prompt, params)
        ids = []
        for prompt, params, prio in zip(prompts, sampling_params, priority):
            ids.append(str(self._next_id))
            self._next_id += 1
            self.engine.add_request(ids[-1], prompt, params, priority=prio)

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate
        (``continue_final_message``: the last message's text is continued, as vLLM's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.inputs.apply_chat_template(
            c, add_generation_prompt, continue_final_message=continue_final_message)}
            for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

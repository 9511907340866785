"""Offline inference in vLLM's shape: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from tqdm import tqdm

from conveyor.config import EngineConfig
from conveyor.engine.engine import LLMEngine, Prompt
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | str | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, policy: str = "continuous",
                 kv_layout: str = "paged", enable_prefix_caching: bool = True, scheduling_policy: str = "fcfs",
                 seed: int = 0, device: str | None = None, threads: int | None = None,
                 quantization: str | None = None, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, distributed_init_method: str | None = None) -> None:
        if data_parallel_size != 1:
            raise ValueError("data-parallel replicas run behind the server: "
                             "conveyor serve --data-parallel-size N")
        self.engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            policy=policy, kv_layout=kv_layout, enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy, seed=seed, device=device, threads=threads,
            quantization=quantization, tensor_parallel_size=tensor_parallel_size,
            distributed_init_method=distributed_init_method))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order.

        ``priority`` (one per prompt, lower first) matters under ``scheduling_policy="priority"``."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
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
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(c, add_generation_prompt)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

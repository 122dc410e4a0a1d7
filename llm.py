"""The offline API: `LLM(model).generate(prompts, sampling)`, a public contract."""

from __future__ import annotations

from collections import deque
from typing import Any

from tqdm import tqdm

from tandem.engine.config import ModelConfig, check_expert_split_of
from tandem.engine.distributed import TPGroup
from tandem.engine.hub import resolve_model_dir
from tandem.engine.lora.peft_format import read_adapter
from tandem.replicas.detokenizer import IncrementalDetokenizer, TokenDecoder
from tandem.replicas.llm_replica import to_spec
from tandem.replicas.local_group import RemoteGroup
from tandem.replicas.request_output import RequestOutput
from tandem.scheduler.messages import AbortRequest, AddRequest, LoRARequest, SchedulerMsg, TokenOutput
from tandem.scheduler.progress import tqdm_progress
from tandem.scheduler.runtime import RankRuntime, RuntimeOptions
from tandem.scheduler.sampling_params import SamplingParams


class LLM:
    """Offline generation over one model copy. tp_size > 1 runs rank actors on a local Ray cluster.

    `engine_options` are the other options of `RuntimeOptions` / `EngineOptions` (scheduler/options.py,
    engine/options.py), e.g. `quantization="fp8"`, `kv_cache_dtype="fp8_e4m3"`, `max_model_len=...`, or
    `enable_lora=True, max_loras=4, max_lora_rank=16` for `generate(..., lora_request=...)`; an unknown
    name is a TypeError, a bad value a ValueError naming the option.
    """

    def __init__(
        self,
        model: str,
        *,
        tp_size: int = 1,
        device: str = "auto",
        dtype: str = "auto",
        page_size: int | None = None,
        chunk_size: int | None = None,
        prefix_cache: bool = True,
        overlap: bool = True,
        cuda_graph: bool = True,
        max_running: int | None = None,
        seed: int = 0,
        **engine_options: Any,
    ) -> None:
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        from transformers import AutoTokenizer

        dummy = engine_options.get("load_format") == "dummy"
        self.model_dir = resolve_model_dir(model, weights=not dummy)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._token_decoder = TokenDecoder(self.tokenizer)
        options = RuntimeOptions.of(
            device=device,
            dtype=dtype,
            page_size=page_size,
            chunk_size=chunk_size,
            prefix_cache=prefix_cache,
            overlap=overlap,
            cuda_graph=cuda_graph,
            max_running=max_running,
            seed=seed,
            **engine_options,
        )
        if tp_size > 1:  # said here, before any rank actor starts
            ep = options.engine.enable_expert_parallel
            check_expert_split_of(self.model_dir, tp_size, expert_parallel=ep)
        self._inbox: deque[SchedulerMsg] = deque()
        self._outputs: list[TokenOutput] = []
        self._remote: RemoteGroup | None = None
        if tp_size > 1:
            self._remote = RemoteGroup(str(self.model_dir), tp_size, options)
            self.limits = self._remote.limits
        else:
            self.runtime = RankRuntime(
                self.model_dir, options, TPGroup(), self._outputs.extend, tqdm_progress("loading weights")
            )
            self.limits = self.runtime.limits()
        self.vocab_size = self.limits.vocab_size
        self._next_rid = 0
        self._lora_options = options.engine
        self._loras: dict[int, str] = {}  # adapter id -> path, each checked once

    def _receive(self, blocking: bool) -> list[SchedulerMsg]:
        msgs = list(self._inbox)
        self._inbox.clear()
        return msgs

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size}), got {bad[:3]}")
        return ids

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not ids:
            raise ValueError("prompt is empty")
        reason = self.limits.admission_error(len(ids), params.max_tokens)
        if reason is not None:
            raise ValueError(reason)

    def _check_lora(self, lora: LoRARequest) -> None:
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a tandem.LoRARequest, got {type(lora).__name__}")
        if not self._lora_options.enable_lora:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        if not isinstance(lora.lora_int_id, int) or lora.lora_int_id < 1:
            raise ValueError(f"LoRARequest ids must be ints >= 1, got {lora.lora_int_id!r}")
        known = self._loras.get(lora.lora_int_id)
        if known is not None and known != lora.lora_path:
            raise ValueError(
                f"LoRA id {lora.lora_int_id} is already {known!r}; another adapter needs another id"
            )
        if known is None:
            read_adapter(
                lora.lora_path, ModelConfig.from_dir(self.model_dir), self._lora_options.max_lora_rank
            )
            self._loras[lora.lora_int_id] = lora.lora_path

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one per prompt (None: the base model), as
        vLLM takes it; LLM(..., enable_lora=True) must be set. A bad adapter is a ValueError naming it."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = [self._prompt_ids(p) for p in prompts]
        for i, p in zip(ids, params):
            self._check(i, p)  # everything is validated before anything is admitted
        for lora in loras:
            if lora is not None:
                self._check_lora(lora)
        if self._remote is not None:
            return self._remote.generate(ids, params, use_tqdm, loras)
        return self._run(ids, params, use_tqdm, loras)

    def _run(
        self,
        ids: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        results: dict[int, RequestOutput] = {}
        detoks: dict[int, IncrementalDetokenizer] = {}
        for prompt_ids, p, lora in zip(ids, params, loras):
            rid = self._next_rid
            self._next_rid += 1
            results[rid] = RequestOutput(prompt_token_ids=prompt_ids)
            if p.stop_strings:
                detoks[rid] = IncrementalDetokenizer(self._token_decoder, prompt_ids, p.stop_strings)
            self._inbox.append(AddRequest(rid, prompt_ids, to_spec(p), lora))
        bar = tqdm(total=len(results), desc="generate", disable=not use_tqdm, unit="req")
        pending = len(results)
        while pending:
            self.runtime.step(self._receive)
            outputs, self._outputs[:] = list(self._outputs), []
            for out in outputs:
                res = results.get(out.rid)
                if res is None or res.finish_reason is not None:
                    continue
                if out.cached_tokens is not None:
                    res.num_cached_tokens = out.cached_tokens
                res.add_prompt_logprobs(out.prompt_logprobs, out.prompt_top_logprobs)
                if out.token_id is not None:
                    res.token_ids.append(out.token_id)
                    if out.logprob is not None:
                        res.logprobs.append(out.logprob)
                    if out.top_logprobs is not None:
                        res.top_logprobs.append(out.top_logprobs)
                    detok = detoks.get(out.rid)
                    if detok is not None:
                        detok.add(out.token_id)
                        if detok.stopped:  # a stop string ended it: the ranks stop it too
                            res.finish_reason = "stop"
                            self._inbox.append(AbortRequest(out.rid))
                if out.finish_reason is not None and res.finish_reason is None:
                    res.finish_reason = out.finish_reason
                if res.finish_reason is not None:
                    pending -= 1
                    bar.update(1)
        while self.runtime.busy:  # let aborted requests drain so their pages return
            self.runtime.step(self._receive)
        self._outputs.clear()
        bar.close()
        for rid, res in results.items():
            detok = detoks.get(rid)
            if detok is not None:
                detok.flush()
                res.text = detok.text
            else:
                res.text = str(self.tokenizer.decode(res.token_ids, skip_special_tokens=True))
        return list(results.values())

    def stats(self) -> dict[str, Any]:
        if self._remote is not None:
            return self._remote.stats()
        return dict(self.runtime.scheduler.stats())

    def shutdown(self) -> None:
        self._inbox.clear()
        if self._remote is not None:
            self._remote.shutdown()
            self._remote = None

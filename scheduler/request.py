"""The scheduler's state for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.scheduler.messages import LoRARequest, SamplingSpec
from tandem.scheduler.structured.grammar import GrammarState

_SEED_MASK = (1 << 62) - 1


@dataclass(eq=False)
class Request:
    """Lengths advance at schedule time, before the sampled values are known on the host.

    - `kv_len`: tokens whose KV has been scheduled (computed or in flight).
    - `device_len`: tokens whose ids are (or will be, once in-flight batches land) in the token pool:
      the prompt plus every output scheduled so far.
    - `output_ids`: outputs the host has seen; it lags `device_len` by the in-flight steps.
    """

    rid: int
    prompt_ids: list[int]
    sampling: SamplingSpec
    seed: int
    slot: int = -1
    kv_len: int = 0
    device_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Pages per KV group, by logical page index; entries below `evicted[g]` pages are freed.
    pages: list[list[int]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  # pages promised but not yet allocated
    cached_prefix: int = 0  # tokens matched in the prefix cache (their pages are the tree's)
    # The hit at admission, as reported; `cached_prefix` grows when the window tree takes the prompt.
    num_cached_tokens: int = 0
    prefix_handle: object | None = None
    # With the window tree: holds its prompt's window pages until the prompt goes to the tree.
    window_hold: bool = False
    last_batch: int = -1  # id of the latest batch this request was scheduled in
    released: bool = False  # its pages have gone back to the pool or the prefix cache
    grammar: GrammarState | None = None  # its structured-output matcher, if it has a constraint
    lora: LoRARequest | None = None  # its adapter; None: the base model
    lora_slot: int = -1  # the GPU slot its adapter is in while it runs
    draft_backoff: int = 0  # speculative decoding: plain steps left before its next draft lookup
    # With sampling.prompt_logprobs: the prompt tokens' log-probs so far (position 1 on), chunk by chunk.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    # Cached: read several times per request per step, and prompt_ids never changes.
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt_ids)
        if not self.device_len:
            self.device_len = self.prompt_len

    @staticmethod
    def derive_seed(base_seed: int, rid: int, seed: int | None) -> int:
        if seed is not None:
            return seed & _SEED_MASK
        return (base_seed * 1_000_003 + rid * 7919 + 1) & _SEED_MASK

    @property
    def scheduled_outputs(self) -> int:
        return self.device_len - self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.kv_len < self.prompt_len

    def wants_more(self, max_seq_len: int) -> bool:
        """True while another step could produce an output (as far as schedule-time lengths know)."""
        return (
            self.finish_reason is None
            and self.scheduled_outputs < self.sampling.max_tokens
            and self.device_len < max_seq_len
        )

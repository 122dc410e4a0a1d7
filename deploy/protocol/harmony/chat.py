"""`HarmonyChat`: how a gpt-oss model's chats are served, decided once when the server starts.

A chat job gets the harmony rendering (`reasoning_effort` for the template, medium unless the request
says otherwise; messages as gpt-oss's template takes them) and stops at `<|return|>` and `<|call|>`; its
replies are read by channel (chat_format.py). Output constraints are refused: they would constrain the
reply from its first token, which is the analysis channel's header, not the answer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tandem.deploy.protocol.errors import invalid_request
from tandem.deploy.protocol.harmony.chat_format import HarmonyChatFormat
from tandem.deploy.protocol.harmony.messages import harmony_messages
from tandem.deploy.protocol.harmony.parser import HarmonyReply, read_reply
from tandem.deploy.protocol.harmony.template import HARMONY_TEMPLATE
from tandem.deploy.protocol.harmony.tokens import HarmonyTokens, uses_harmony
from tandem.deploy.protocol.jobs import GenerateJob
from tandem.deploy.protocol.tool_calls import new_call_id

REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_REASONING_EFFORT = "medium"
HARMONY_REASONING_PARSER = "openai_gptoss"  # vLLM's --reasoning-parser name for gpt-oss: harmony


class HarmonyChat:
    def __init__(self, tokens: HarmonyTokens) -> None:
        self.tokens = tokens

    @classmethod
    def for_model(
        cls, model_type: str | None, tokenizer: Any, reasoning_parser: str | None = None
    ) -> HarmonyChat | None:
        """The harmony format for a gpt-oss model (config.json `model_type` "gpt_oss") or under
        `--reasoning-parser openai_gptoss`, None for others. A ValueError naming the flag for another
        reasoning parser on a gpt-oss model, and when the model's tokenizer lacks the harmony tokens."""
        asked = reasoning_parser == HARMONY_REASONING_PARSER
        if uses_harmony(model_type) and reasoning_parser is not None and not asked:
            raise ValueError(
                f"--reasoning-parser (reasoning_parser) {reasoning_parser!r} does not apply to this "
                f"{model_type} model, whose chats are served in the harmony format (its analysis channel "
                f"is the reasoning): leave it unset or set {HARMONY_REASONING_PARSER!r}"
            )
        if not (asked or uses_harmony(model_type)):
            return None
        try:
            return cls(HarmonyTokens.of(tokenizer))
        except ValueError as exc:
            if not asked:
                raise
            raise ValueError(f"--reasoning-parser {HARMONY_REASONING_PARSER}: {exc}") from None

    @staticmethod
    def chat_template(configured: str | None, tokenizer: Any) -> str | None:
        """The template to render with: the server's, else the model's own (None), else tandem's harmony
        template, so that a gpt-oss checkpoint without one is still prompted in harmony."""
        if configured is not None or getattr(tokenizer, "chat_template", None):
            return configured
        return HARMONY_TEMPLATE

    def prepare(self, job: GenerateJob) -> GenerateJob:
        """The job rendered and stopped as harmony; an OpenAIError (400) for what harmony cannot serve."""
        if job.sampling.structured_outputs is not None:
            # A forced tool call is a constraint too (job_builder.py names it "tools").
            param = (
                "tool_choice"
                if job.structured_param == "tools"
                else job.structured_param or "response_format"
            )
            raise invalid_request(
                f"{param} cannot constrain this model's output: it writes its reply in the harmony "
                "format, reasoning first, which a constraint from the first token would break",
                param=param,
                code="unsupported_parameter",
            )
        kwargs = dict(job.chat_template_kwargs or {})
        effort = kwargs.setdefault("reasoning_effort", DEFAULT_REASONING_EFFORT)
        if effort not in REASONING_EFFORTS:
            raise invalid_request(
                f"chat_template_kwargs.reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                f"got {effort!r}",
                param="chat_template_kwargs.reasoning_effort",
            )
        stops = list(job.sampling.stop_token_ids or [])
        if not job.sampling.ignore_eos:  # ignore_eos (benchmarks) runs to max_tokens, as for any model
            stops += [t for t in self.tokens.stops if t not in stops]
        # tool_choice "none": the model is shown no functions, so it has none to call.
        shown = job.tool_mode is not None and job.tool_mode.choice != "none"
        return replace(
            job,
            messages=harmony_messages(job.messages or []),
            chat_template_kwargs=kwargs,
            tools=job.tools if shown else None,
            sampling=replace(job.sampling, stop_token_ids=stops),
        )

    def read(self, token_ids: list[int], job: GenerateJob) -> HarmonyReply:
        """A whole reply of `job` (prepared), read by channel; its stop strings cut the fields."""
        return read_reply(self.tokens, token_ids, new_call_id, job.sampling.stop_strings)

    def chat_format(self, job: GenerateJob, model: str, created: int) -> HarmonyChatFormat:
        """The format that reads the replies of `job` (prepared): its stop strings cut the fields."""
        return HarmonyChatFormat(job.request_id, model, created, self.tokens, job.sampling.stop_strings)

"""tandem's harmony chat template, for a gpt-oss checkpoint whose tokenizer ships no template of its own.

It takes what gpt-oss's own template takes: `messages` (as messages.py prepares them), `tools`,
`reasoning_effort` (default medium), `model_identity`, `add_generation_prompt`; and it renders:

- a system message: identity, knowledge cutoff, today's date, reasoning effort, the valid channels;
- a developer message: the first system (or developer) message as `# Instructions`, and the tools as
  the `functions` namespace of TypeScript-like type declarations;
- the history: user turns, the assistant's `final` answers (earlier turns' reasoning dropped, as the
  model was trained), its tool calls on the `commentary` channel (with the `analysis` before them while
  no later answer exists), and each tool's result as a message from `functions.NAME`.
"""

from __future__ import annotations

HARMONY_TEMPLATE = r"""
{%- macro ts_type(spec) -%}
  {%- if spec.enum is defined and spec.enum -%}
    {{- spec.enum | map('tojson') | join(' | ') -}}
  {%- elif spec.anyOf is defined or spec.oneOf is defined -%}
    {%- set variants = spec.anyOf if spec.anyOf is defined else spec.oneOf -%}
    {%- for variant in variants -%}{{- ts_type(variant) -}}{{- ' | ' if not loop.last -}}{%- endfor -%}
  {%- elif spec.type is defined and spec.type is not string and spec.type is iterable -%}
    {%- for kind in spec.type -%}{{- ts_type({'type': kind}) -}}{{- ' | ' if not loop.last -}}{%- endfor -%}
  {%- elif spec.type == 'string' -%}string
  {%- elif spec.type in ('number', 'integer') -%}number
  {%- elif spec.type == 'boolean' -%}boolean
  {%- elif spec.type == 'null' -%}null
  {%- elif spec.type == 'array' -%}
    {{- (ts_type(spec['items']) if spec['items'] is defined else 'any') + '[]' -}}
  {%- elif spec.type == 'object' and spec.properties is defined and spec.properties -%}
    {{- '{ ' -}}
    {%- for name, prop in spec.properties.items() -%}
      {{- name + ('' if name in (spec.required or []) else '?') + ': ' + ts_type(prop) -}}
      {{- ', ' if not loop.last -}}
    {%- endfor -%}
    {{- ' }' -}}
  {%- elif spec.type == 'object' -%}object
  {%- else -%}any
  {%- endif -%}
{%- endmacro -%}

{%- macro functions_namespace(tools) -%}
  {{- '## functions\n\nnamespace functions {\n\n' -}}
  {%- for tool in tools -%}
    {%- set fn = tool.function if tool.function is defined else tool -%}
    {%- if fn.description -%}{{- '// ' + fn.description + '\n' -}}{%- endif -%}
    {%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} -%}
    {%- if params.properties is defined and params.properties -%}
      {{- 'type ' + fn.name + ' = (_: {\n' -}}
      {%- for name, prop in params.properties.items() -%}
        {%- if prop.description -%}{{- '// ' + prop.description + '\n' -}}{%- endif -%}
        {{- name + ('' if name in (params.required or []) else '?') + ': ' + ts_type(prop) -}}
        {%- if prop.default is defined -%}{{- ', // default: ' + prop.default | tojson + '\n' -}}
        {%- else -%}{{- ',\n' -}}{%- endif -%}
      {%- endfor -%}
      {{- '}) => any;\n\n' -}}
    {%- else -%}
      {{- 'type ' + fn.name + ' = () => any;\n\n' -}}
    {%- endif -%}
  {%- endfor -%}
  {{- '} // namespace functions' -}}
{%- endmacro -%}

{{- '<|start|>system<|message|>' -}}
{{- (model_identity if model_identity is defined else
     'You are ChatGPT, a large language model trained by OpenAI.') + '\n' -}}
{{- 'Knowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\n' -}}
{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}

{%- set history = messages -%}
{%- set instructions = '' -%}
{%- if messages and messages[0].role in ('system', 'developer') -%}
  {%- set instructions = messages[0].content -%}
  {%- set history = messages[1:] -%}
{%- endif -%}
{%- if instructions or tools -%}
  {{- '<|start|>developer<|message|>' -}}
  {%- if instructions -%}{{- '# Instructions\n\n' + instructions + '\n\n' -}}{%- endif -%}
  {%- if tools -%}{{- '# Tools\n\n' + functions_namespace(tools) -}}{%- endif -%}
  {{- '<|end|>' -}}
{%- endif -%}

{%- set state = namespace(called=none) -%}
{%- for message in history -%}
  {%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls -%}
    {%- set answered = namespace(later=false) -%}
    {%- for later in history[loop.index:] -%}
      {%- if later.role == 'assistant' and not (later.tool_calls is defined and later.tool_calls) -%}
        {%- set answered.later = true -%}
      {%- endif -%}
    {%- endfor -%}
    {%- set analysis = message.thinking if message.thinking is defined and message.thinking
                       else message.content -%}
    {%- if analysis and not answered.later -%}
      {{- '<|start|>assistant<|channel|>analysis<|message|>' + analysis + '<|end|>' -}}
    {%- endif -%}
    {%- set call = message.tool_calls[0].function if message.tool_calls[0].function is defined
                   else message.tool_calls[0] -%}
    {%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson -%}
    {{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' -}}
    {{- arguments + '<|call|>' -}}
    {%- set state.called = call.name -%}
  {%- elif message.role == 'assistant' -%}
    {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' -}}
  {%- elif message.role == 'tool' -%}
    {%- if state.called is none -%}
      {{- raise_exception('a tool message must follow an assistant message with a tool call') -}}
    {%- endif -%}
    {{- '<|start|>functions.' + state.called + ' to=assistant<|channel|>commentary<|message|>' -}}
    {{- message.content + '<|end|>' -}}
  {%- elif message.role in ('system', 'developer') -%}
    {{- '<|start|>developer<|message|># Instructions\n\n' + message.content + '\n\n<|end|>' -}}
  {%- else -%}
    {{- '<|start|>user<|message|>' + message.content + '<|end|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""

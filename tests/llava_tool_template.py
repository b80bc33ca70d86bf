"""A Hermes-style chat template with tools for the tiny LLaVA (its own template has none), as a deployer
would write one for ``--chat-template``: LLaVA-1.5's turns (``USER: <image>\\n… ASSISTANT:``), the tools
listed in a first system line, calls written as the Qwen families write them
(``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``, what ``--tool-call-parser hermes`` reads) and
results as ``<tool_response>`` turns."""

from __future__ import annotations

from workers.families.llava.tiny import RENDER_MACRO

LLAVA_HERMES_TEMPLATE = (
    RENDER_MACRO
    + r"""
{%- if tools -%}
    {{- 'TOOLS: You may call one or more functions, listed within <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\nCall one as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        '</tool_call>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {{- render(message['content']) + ' ' -}}
    {%- elif message['role'] == 'user' -%}
        {{- 'USER: ' + render(message['content']) + ' ' -}}
    {%- elif message['role'] == 'tool' -%}
        {{- 'USER: <tool_response>\n' + render(message['content']) + '\n</tool_response> ' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- 'ASSISTANT: ' + render(message['content']) -}}
        {%- for call in message.get('tool_calls') or [] -%}
            {%- set function = call['function'] if call.get('function') else call -%}
            {{- '<tool_call>\n{"name": "' + function['name'] + '", "arguments": ' -}}
            {%- if function['arguments'] is string -%}
                {{- function['arguments'] -}}
            {%- else -%}
                {{- function['arguments'] | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '</s>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'ASSISTANT:' -}}
{%- endif -%}
"""
)

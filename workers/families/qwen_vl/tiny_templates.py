"""The tiny Qwen-VL checkpoints' chat templates (workers/families/qwen_vl/tiny.py), written to render what
the real checkpoints' templates render.

Content is a string or an OpenAI-like part list: "image" / "image_url" parts become one
``<|vision_start|><|image_pad|><|vision_end|>``, "video" / "video_url" parts one
``<|vision_start|><|video_pad|><|vision_end|>`` (the processor expands each pad token to the item's
tokens; Qwen3-VL's processor also writes each frame's timestamp there), "text" parts their text.

With ``tools`` (the Qwen2.5 / Qwen3 Hermes format, as the real templates that have tools write it):

- the system turn lists the tools' JSON inside ``<tools></tools>`` and says how to call them;
- an assistant message's ``tool_calls`` follow its content, each as
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``;
- consecutive ``tool`` messages become one user turn of ``<tool_response>`` blocks.

Qwen2-VL's and Qwen2.5-VL's processor templates have no tools (as the real ones); Qwen2.5-VL's tokenizer
carries the Qwen2.5 template that has them, Qwen3-VL's processor template has them itself.
"""

from __future__ import annotations

_RENDER_CONTENT = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is not none -%}
        {%- for part in content -%}
            {%- if part['type'] in ['image', 'image_url'] or 'image' in part or 'image_url' in part -%}
                {%- set image_count.value = image_count.value + 1 -%}
                {%- if add_vision_id -%}{{- 'Picture ' ~ image_count.value ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part['type'] in ['video', 'video_url'] or 'video' in part or 'video_url' in part -%}
                {%- set video_count.value = video_count.value + 1 -%}
                {%- if add_vision_id -%}{{- 'Video ' ~ video_count.value ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
"""
_QWEN3_SYSTEM_CHECK = r"""
    {%- if message['role'] == 'system' and '<|video_pad|>' in content -%}
        {{- raise_exception('System message cannot contain videos.') -}}
    {%- elif message['role'] == 'system' and '<|vision_start|>' in content -%}
        {{- raise_exception('System message cannot contain images.') -}}
    {%- endif -%}
"""
_TOOLS_SYSTEM = r"""
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0]['role'] == 'system' -%}
        {{- render_content(messages[0]['content']) + '\n\n' -}}
    {%- elif default_system -%}
        {{- default_system + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0]['role'] != 'system' and default_system -%}
    {{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' -}}
{%- endif -%}
"""
_TURNS = r"""
{%- for message in messages -%}
    {%- set content = render_content(message['content']) -%}
    SYSTEM_CHECK
    {%- if message['role'] == 'system' and loop.first and tools -%}
    {%- elif message['role'] == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}
        {{- '<|im_start|>assistant\n' + content -}}
        {%- for call in message['tool_calls'] -%}
            {%- set function = call['function'] if call.get('function') else call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + function['name'] + '", "arguments": ' -}}
            {%- if function['arguments'] is string -%}
                {{- function['arguments'] -}}
            {%- else -%}
                {{- function['arguments'] | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""
_QWEN2_DEFAULT_SYSTEM = "{%- set default_system = 'You are a helpful assistant.' -%}\n"
_NO_DEFAULT_SYSTEM = "{%- set default_system = '' -%}\n"
# Templates without tools keep the plain turns (no tool branch is ever taken: ``tools`` is undefined)
_PLAIN_TURNS = r"""
{%- if messages[0]['role'] != 'system' and default_system -%}
    {{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set content = render_content(message['content']) -%}
    SYSTEM_CHECK
    {{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def _template(default_system: str, turns: str, qwen3: bool) -> str:
    return (
        default_system + _RENDER_CONTENT + turns.replace("SYSTEM_CHECK", _QWEN3_SYSTEM_CHECK if qwen3 else "")
    )


# Qwen2-VL's processor template, which Qwen2.5-VL's shares: a default system prompt, no tools
QWEN2_CHAT_TEMPLATE = _template(_QWEN2_DEFAULT_SYSTEM, _PLAIN_TURNS, qwen3=False)
# Qwen2.5's (its tokenizer's): the same turns, with tools
QWEN2_5_TOOLS_CHAT_TEMPLATE = _template(_QWEN2_DEFAULT_SYSTEM, _TOOLS_SYSTEM + _TURNS, qwen3=False)
# Qwen3-VL's: no default system prompt, a system message may not carry images or videos; tools
QWEN3_CHAT_TEMPLATE = _template(_NO_DEFAULT_SYSTEM, _TOOLS_SYSTEM + _TURNS, qwen3=True)

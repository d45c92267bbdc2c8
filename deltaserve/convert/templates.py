"""Chat templates for the random-weight presets, written for deltaserve (not copied from any release) and
shaped like the real ones, so that thinking, tool calls and multi-turn histories can be exercised:

- QWEN35: Qwen3.5's conventions. A tools block in the system turn; calls in XML
  (<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>);
  tool results as <tool_response> inside a user turn; the generation prompt opens <think> (or closes an
  empty one with enable_thinking=false); an earlier assistant turn is rendered without its thinking.
- QWEN3_JSON: the same with calls as JSON inside <tool_call> (the "hermes" form of Qwen3 / Qwen3-Next).

Tool-call arguments may be given as a mapping (rendered per parameter) or as the JSON text the OpenAI API
carries (rendered as it is).
"""

_SYSTEM = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more of these functions to help with the request:
<tools>
{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}
{% endfor %}</tools>

{{ call_format }}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}"""

_TURNS = """{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% if not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
{%- elif m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}
{%- set content = (m.content or '').split('</think>')[-1].lstrip('\\n') %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' %}
<|im_start|>assistant
{% if loop.index0 > ns.last_user and reasoning %}<think>
{{ reasoning.strip() }}
</think>

{% endif %}{{ content }}
{%- if m.tool_calls is defined and m.tool_calls %}{% for call in m.tool_calls %}
{%- set f = call.function if call.function is defined else call %}
{%- set args = f.arguments %}
{% if content or not loop.first %}
{% endif %}{{ render_call(f.name, args) }}{% endfor %}{% endif %}<|im_end|>
{% elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% else %}{{ '\n' }}{% endif %}<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

_XML_CALL = """{%- macro render_call(name, args) %}<tool_call>
<function={{ name }}>
{% if args is mapping %}{% for key, value in args.items() %}<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}{% else %}{{ args }}
{% endif %}</function>
</tool_call>{% endmacro %}"""

_JSON_CALL = """{%- macro render_call(name, args) %}<tool_call>
{"name": {{ name | tojson }}, "arguments": {{ args if args is string else args | tojson }}}
</tool_call>{% endmacro %}"""

_XML_FORMAT = ("To call a function, reply with\\n<tool_call>\\n<function=NAME>\\n<parameter=PARAMETER>\\nvalue\\n"
               "</parameter>\\n</function>\\n</tool_call>")
_JSON_FORMAT = 'To call a function, reply with\\n<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>'

QWEN35 = _XML_CALL + "{%- set call_format = '" + _XML_FORMAT + "' %}" + _SYSTEM + _TURNS
QWEN3_JSON = _JSON_CALL + "{%- set call_format = '" + _JSON_FORMAT + "' %}" + _SYSTEM + _TURNS

# tokens the templates use: added to the presets' vocabulary whole, kept in decoded text (not control tokens)
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

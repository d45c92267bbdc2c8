"""Chat templates for the random-weight presets, written for deltaserve (not copied from any release). Their
wording of the tools block is their own; everything else renders as the real templates do for the same
messages (tests/convert/test_templates.py renders both and compares), so that thinking, tool calls and
multi-turn histories can be exercised as a served model meets them:

- QWEN35: Qwen3.5's. A system turn holding the tools (each as JSON on its own line) and then the system
  message; calls in XML (callforms: <function=NAME> and one <parameter=...> per argument, a string as it
  is, a list or mapping as JSON); tool results as <tool_response> blocks inside one user turn; every
  message's text trimmed; the generation prompt opens <think> (or writes an empty block with
  enable_thinking=false); an assistant turn after the last user query keeps its thinking (an empty block
  if it had none), earlier ones lose it.
- QWEN3_JSON: Qwen3's (and Qwen3-Next's hermes form). The system message, then the tools; calls as JSON
  inside <tool_call>; text as given; the generation prompt opens no <think> (the model opens it itself),
  enable_thinking=false writes an empty block; the last turn after the query keeps its thinking.

Tool-call arguments may be a mapping or, in the JSON form, the JSON text the OpenAI API carries.
"""

# An assistant turn's thinking: its reasoning_content, else what its content holds before </think>.
_SPLIT_THINKING = """
{%- macro split_thinking(m, content) %}
{%- if m.reasoning_content is string %}{{ m.reasoning_content }}
{%- elif '</think>' in content %}{{ content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}
{%- endif %}{% endmacro %}
{%- macro after_thinking(m, content) %}
{%- if m.reasoning_content is not string and '</think>' in content %}{{ content.split('</think>')[-1].lstrip('\\n') }}
{%- else %}{{ content }}{% endif %}{% endmacro %}"""

# The index of the last user message that is a query, not tool results handed back as a user turn (with
# none, the last message's).
_LAST_QUERY = """
{%- set query = namespace(index=messages | length - 1, found=false) %}
{%- for m in messages %}
{%- if m.role == 'user' %}{% set text = (m.content or '') | trim %}
{%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
{%- set query.index = loop.index0 %}{% set query.found = true %}{% endif %}
{%- endif %}{% endfor %}"""


def _tool_results(opens_turn: str) -> str:
    """Consecutive tool messages as <tool_response> blocks of one user turn (opens_turn: when a tool
    message opens that turn)."""
    return """
{%- elif m.role == 'tool' %}
{%- if """ + opens_turn + """ %}<|im_start|>user{% endif %}
{{- '\\n<tool_response>\\n' ~ text ~ '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}"""

_TOOLS_LIST = """<tools>{% for tool in tools %}{{ '\\n' ~ tool | tojson }}{% endfor %}{{ '\\n</tools>' }}"""

QWEN35 = """{%- if not messages %}{{ raise_exception('there are no messages') }}{% endif %}
{%- set first_system = (messages[0].content or '') | trim if messages[0].role == 'system' else '' %}
{%- if tools %}<|im_start|>system
# Tools

These functions are available to you:

""" + _TOOLS_LIST + """

To call one, write exactly this and nothing after it (one <parameter> block per argument):

<tool_call>
<function=NAME>
<parameter=ARGUMENT>
value
</parameter>
</function>
</tool_call>

Give every required argument. Any explanation goes before the call. If no function helps, answer as usual.
{%- if first_system %}{{ '\\n\\n' ~ first_system }}{% endif %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ first_system }}<|im_end|>
{% endif %}""" + _LAST_QUERY + """
{%- if not query.found %}{{ raise_exception('there is no user query among the messages') }}{% endif %}""" + _SPLIT_THINKING + """
{%- for m in messages %}{% set text = (m.content or '') | trim %}
{%- if m.role == 'system' %}{% if not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
{%- elif m.role == 'user' %}<|im_start|>user
{{ text }}<|im_end|>
{% elif m.role == 'assistant' %}
{%- set reasoning = split_thinking(m, text) | trim %}{% set content = after_thinking(m, text) %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > query.index %}{{ '<think>\\n' ~ reasoning ~ '\\n</think>\\n\\n' }}{% endif %}{{ content }}
{%- for call in m.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}
{%- if not loop.first %}{{ '\\n' }}{% elif content | trim %}{{ '\\n\\n' }}{% endif %}
{{- '<tool_call>\\n<function=' ~ f.name ~ '>\\n' }}
{%- for key, value in (f.arguments | items if f.arguments is defined else []) %}
{{- '<parameter=' ~ key ~ '>\\n' }}
{{- value | tojson if value is mapping or (value is sequence and value is not string) else value | string }}
{{- '\\n</parameter>\\n' }}
{%- endfor %}</function>
</tool_call>
{%- endfor %}{{ '<|im_end|>\\n' }}""" + _tool_results("not loop.first and messages[loop.index0 - 1].role != 'tool'") + """
{%- else %}{{ raise_exception('unexpected message role: ' ~ m.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

QWEN3_JSON = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content ~ '\\n\\n' }}{% endif %}# Tools

You may call functions to help with the user's request. Their signatures, inside <tools></tools>:
""" + _TOOLS_LIST + """

To call one, write a JSON object with its name and arguments inside <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}""" + _LAST_QUERY + """
""" + _SPLIT_THINKING + """
{%- for m in messages %}{% set text = m.content or '' %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' ~ m.role ~ '\\n' ~ text ~ '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set reasoning = split_thinking(m, text) %}{% set content = after_thinking(m, text) %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > query.index and (loop.last or reasoning) %}
{{- '<think>\\n' ~ reasoning.strip('\\n') ~ '\\n</think>\\n\\n' ~ content.lstrip('\\n') }}
{%- else %}{{ content }}{% endif %}
{%- for call in m.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}
{%- if not loop.first or content %}{{ '\\n' }}{% endif %}
{{- '<tool_call>\\n{"name": "' ~ f.name ~ '", "arguments": ' }}
{{- f.arguments if f.arguments is string else f.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}{{ '<|im_end|>\\n' }}""" + _tool_results("loop.first or messages[loop.index0 - 1].role != 'tool'") + """
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# tokens the templates use: added to the presets' vocabulary whole, kept in decoded text (not control tokens)
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

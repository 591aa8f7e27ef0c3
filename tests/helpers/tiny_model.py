"""Build a tiny real model for the vLLM tier, with no download (run by the vLLM environment's Python).

Usage: ``python tests/helpers/tiny_model.py OUT_DIR VARIANT`` with VARIANT one of :data:`VARIANTS`.

The tokenizer is a no-merge vocabulary of printable ASCII and ``\\n`` plus specials, built with ``tokenizers``
and wrapped as ``PreTrainedTokenizerFast``: every generation re-encodes to the same ids, so any drift the tests see
comes from the chat template or the engine, never from the tokenizer. The model is a random-initialised
``LlamaForCausalLM`` (hidden 128, 2 layers, vocabulary = tokenizer size, seed 0): its text is gibberish, its ids,
log-probs, templates, parsers and streaming are real. Variants:

* ``chatml``: ChatML (``<|im_start|>role\\n...<|im_end|>\\n``);
* ``reasoning``: DeepSeek-R1 style, the generation prompt opens ``<think>\\n`` and earlier assistant turns keep only
  the text after ``</think>`` (served with ``--reasoning-parser deepseek_r1``);
* ``tools``: ChatML plus tool definitions in a system turn, assistant tool calls rendered pythonic
  (``[name(arg=value)]``) and ``tool`` turns (served with ``--tool-call-parser pythonic --enable-auto-tool-choice``).
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

VARIANTS = ("chatml", "reasoning", "tools")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK = ("<think>", "</think>")
"""Added tokens that are not special (as in DeepSeek-R1's and Qwen3's tokenizers): the text shows them."""

_TURN = "<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
_GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

CHATML = "{% for m in messages %}" + _TURN + "{% endfor %}" + _GENERATION

REASONING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set c = m['content'] or '' %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n"
    "{% else %}" + _TURN + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

TOOLS = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' and m['tool_calls'] %}"
    "<|im_start|>assistant\n{{ m['content'] or '' }}["
    "{% for c in m['tool_calls'] %}{{ c['function']['name'] }}("
    "{% set a = c['function']['arguments'] %}{% if a is mapping %}"
    "{% for k, v in a.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}"
    "{% else %}{{ a }}{% endif %}){% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>\n"
    "{% else %}" + _TURN + "{% endif %}{% endfor %}" + _GENERATION
)

TEMPLATES = {"chatml": CHATML, "reasoning": REASONING, "tools": TOOLS}


def build(out_dir: Path, variant: str) -> None:
    """Write the tokenizer and the random model of *variant* into *out_dir*."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    characters = [*string.printable[:95], "\n"]  # digits, letters, punctuation, space; then newline
    vocab = {token: index for index, token in enumerate([*SPECIALS, *THINK, *characters])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    core.add_special_tokens(list(SPECIALS))
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK])
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = TEMPLATES[variant]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "staging_sink_variant.json").write_text(json.dumps({"variant": variant, "vocab": vocab}))


if __name__ == "__main__":
    build(Path(sys.argv[1]), sys.argv[2])

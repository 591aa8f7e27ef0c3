"""A trainer's recompute of a row's log-probs with ``transformers`` (run by the vLLM environment's Python).

Usage: ``python tests/helpers/recompute_logprobs.py MODEL_DIR`` with a JSON list of token ids on stdin; prints a JSON
list of the same length: at position ``t`` the model's log-prob of token ``t`` given the tokens before it (float32,
CPU, one forward pass, no sampling transform), ``null`` at position 0 (nothing precedes it).
"""

from __future__ import annotations

import json
import sys


def recompute(model_dir: str, token_ids: list[int]) -> list[float | None]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([token_ids], dtype=torch.long)
        logits = model(input_ids=ids).logits[0].to(torch.float32)
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return [None, *(float(value) for value in logprobs.tolist())]


if __name__ == "__main__":
    json.dump(recompute(sys.argv[1], json.load(sys.stdin)), sys.stdout)

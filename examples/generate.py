"""Answer a question with an exported model, using transformers alone (no cargohold):

    .venv/bin/python examples/generate.py runs/tiny-llama-chat "What is the capital of Peru?"

The export folder (``export_dir``) is what ``save_pretrained`` of a model and its
tokenizer gives, so this is the code for any transformers checkpoint: the chat template
renders the question with the assistant's turn opened, and greedy decoding stops at the
generation config's EOS (the end of a turn).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def answer(folder: Path, question: str, max_new_tokens: int = 48) -> str:
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
    )
    with torch.no_grad():
        tokens = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(tokens[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="an export_dir (or any save_pretrained folder)")
    parser.add_argument("question", nargs="?", default="What is the capital of Peru?")
    args = parser.parse_args(argv)
    print(answer(args.folder, args.question))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

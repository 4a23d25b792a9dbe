"""Hugging Face ``transformers.Trainer`` with ``cargohold.OffloadedAdamW``: the Trainer's
loop (its data loader, gradient accumulation, clipping and logging) with AdamW's state on
state servers, given as ``Trainer(optimizers=(optimizer, scheduler))``. A tiny Llama built
from a local config (nothing is downloaded) learns a repeating token pattern on CPU.

    python examples/hf_trainer.py                      # state servers in this process
    python examples/hf_trainer.py --reference          # torch.optim.AdamW(fused=True) instead
    python examples/hf_trainer.py --out weights.pt     # save the final weights

The two give the same weights, bit for bit: the same loop, and the servers' update is
torch's fused AdamW kernel over the same elements.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, get_cosine_schedule_with_warmup

import cargohold


class Patterns(Dataset):
    """Sequences of a repeating pattern of token ids at a random phase: learnable in a few steps."""

    def __init__(self, size: int = 64, length: int = 32, vocab: int = 128) -> None:
        gen = torch.Generator().manual_seed(0)
        pattern = torch.randint(0, vocab, (8,), generator=gen)
        phases = torch.randint(0, 8, (size,), generator=gen)
        self.ids = torch.stack([pattern.roll(int(p)).repeat(length // 8) for p in phases])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reference", action="store_true", help="torch.optim.AdamW(fused=True) instead")
    parser.add_argument("--out", help="save the final weights here")
    args = parser.parse_args(argv)

    model = tiny_llama()
    # Transformers' rule: no decay on biases and norm weights.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    servers = None if args.reference else cargohold.start_state_servers(in_process=True)
    if servers is None:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=3e-3, fused=True)
    else:
        optimizer = cargohold.OffloadedAdamW(groups, lr=3e-3, model=model, servers=servers)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="cargohold-hf-trainer-") as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_grad_norm=1.0,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=Patterns(), optimizers=(optimizer, scheduler))
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']} loss {entry['loss']:.4f}", flush=True)
    if args.out:
        torch.save(model.state_dict(), args.out)
    if isinstance(optimizer, cargohold.OffloadedAdamW):
        optimizer.close()
    if servers is not None:
        servers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

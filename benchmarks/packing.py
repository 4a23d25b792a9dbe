"""Whole conversations per sequence (``data.packing: documents``) against today's stream
packing, on the shipped conversations and a small Llama, in one run:

    python benchmarks/packing.py                       # examples/data/chat.jsonl, 128-token sequences
    python benchmarks/packing.py --block-size 512 --hidden 256 --layers 4

The model and its tokenizer are made as ``examples/make_tiny_llama.py`` makes them (in a
temporary folder, deleted at the end), at the width asked. For each packing, the data is
opened as a run opens it (:func:`~cargohold.services.data.sources.open_source`), then the
model runs forward and backward (fp32, 1 thread, no Ray: the cost of the packing itself,
not of the offload) on ``--steps`` batches, after one warm-up. Reported per packing:
sequences needed for one pass over the data, padding fraction, input tokens/s and
counted (assistant) tokens/s, seconds per epoch (sequences x seconds per sequence); and
the ratio documents / stream of the epoch time, the baseline being measured in the same
run. Only the training loop's own batches are timed; nothing samples during it. Nothing
is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _example_module():
    spec = importlib.util.spec_from_file_location("make_tiny_llama", REPO / "examples" / "make_tiny_llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO / "examples" / "data" / "chat.jsonl"))
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    import transformers

    from cargohold.cluster.schema.io import from_dict
    from cargohold.cluster.schema.train import TrainConfig
    from cargohold.cluster.sections import config_task
    from cargohold.services.data.blocks import TokenBlocks
    from cargohold.services.data.rows import DocumentRows
    from cargohold.services.models.hf import HFCausalLM

    torch.set_num_threads(1)
    example = _example_module()
    with tempfile.TemporaryDirectory(prefix="cargohold-packing-") as folder:
        model_dir = Path(folder) / "model"
        tokenizer = example.make_tokenizer(Path(args.data), 1024)
        tokenizer.save_pretrained(model_dir)
        transformers.LlamaConfig(
            vocab_size=-(-len(tokenizer) // 64) * 64,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers,
            num_attention_heads=max(1, args.hidden // 32),
            max_position_embeddings=args.block_size,
        ).save_pretrained(model_dir)
        results = {}
        for packing in ("stream", "documents"):
            config = from_dict(
                TrainConfig,
                {
                    "hf": {"config_path": str(model_dir / "config.json")},
                    "data": {
                        "format": "chat",
                        "path": args.data,
                        "tokenizer": str(model_dir),
                        "block_size": args.block_size,
                        "batch_size": args.batch_size,
                        "packing": packing,
                        "cache_dir": str(Path(folder) / "cache"),
                    },
                    "worker": {"num_workers": 1},
                },
            )
            source = config_task(config).open_data()
            torch.manual_seed(0)
            model = HFCausalLM(
                transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
            )
            batches = [source.batch(step, 0) for step in range(1, args.steps + 2)]
            seconds, inputs, counted = 0.0, 0, 0
            for index, batch in enumerate(batches):
                started = time.perf_counter()
                _, loss = model(batch.inputs, batch.targets, position_ids=batch.position_ids)
                assert loss is not None
                loss.backward()
                model.zero_grad(set_to_none=True)
                if index:  # the first is a warm-up
                    seconds += time.perf_counter() - started
                    inputs += batch.inputs.numel()
                    counted += int((batch.targets != -100).sum())
            assert isinstance(source, (TokenBlocks, DocumentRows))
            rows = source.num_blocks
            capacity = args.block_size + 1
            padding = getattr(source, "padding", 0) / (rows * capacity)
            per_sequence = seconds / (args.steps * args.batch_size)
            results[packing] = {
                "sequences": rows,
                "padding": padding,
                "tokens_s": inputs / seconds,
                "counted_s": counted / seconds,
                "epoch_s": rows * per_sequence,
            }
            print(
                f"{packing:>9}: {rows} sequences a pass, padding {100 * padding:.1f}%, "
                f"{inputs / seconds:,.0f} input tokens/s, {counted / seconds:,.0f} counted tokens/s, "
                f"{rows * per_sequence:.1f} s an epoch",
                flush=True,
            )
    documents, stream = results["documents"], results["stream"]
    print(
        f"RATIO documents / stream epoch time = {documents['epoch_s'] / stream['epoch_s']:.2f} "
        f"(sequences {documents['sequences']} vs {stream['sequences']}, "
        f"input tokens/s {documents['tokens_s'] / stream['tokens_s']:.2f}x)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""A Hugging Face GPT-2 (random weights from a config file: nothing is downloaded), trained with ZeRO-3
on 2 local ranks, on dict batches with padding: labels of -100 carry no loss.

    python examples/hf_gpt2_zero3.py
    torchrun --nproc-per-node 2 examples/hf_gpt2_zero3.py
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import shardwise as sw
from shardwise.models.hf import config_path


def sequence(i: int) -> dict:
    ids = torch.arange(i % 7, i % 7 + 24) % 256  # an easy pattern: count upwards
    labels = ids.clone()
    labels[16 + i % 8 :] = -100  # padding at the end, as a tokenizer leaves it
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


def main() -> dict | None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path("hf:tiny-gpt2")))
    overrides = {"strategy": "zero3", "steps": 30, "data.global_batch": 8, "eval_every": 0}
    config = sw.load_config(overrides={**overrides, "run_dir": "runs/hf"})
    return sw.Trainer.build(config, model=model, dataset=[sequence(i) for i in range(256)]).fit(False)


if __name__ == "__main__":
    for summary in filter(None, sw.launch(main, nproc=2)):  # under torchrun: this rank's only
        print(f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}")

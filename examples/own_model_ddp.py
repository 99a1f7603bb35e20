"""Your own model, loss and data, trained on 2 local ranks with shardwise's DDP.

python examples/own_model_ddp.py            # shardwise starts the 2 ranks
torchrun --nproc-per-node 2 examples/own_model_ddp.py
"""

import torch
from torch import nn

import shardwise as sw


def main() -> dict | None:
    torch.manual_seed(0)  # the same initial weights on every run
    x = torch.randn(1024, 8)
    data = torch.utils.data.TensorDataset(x, torch.sin(x.sum(dim=1)))  # learn y = sin(sum(x))
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1), nn.Flatten(0))
    loss = sw.summed(lambda out, batch: ((out - batch[1]) ** 2).sum())  # a SUM: shardwise averages
    overrides = {"strategy": "ddp", "steps": 150, "data.global_batch": 64, "optim.lr": 1e-2, "eval_every": 0}
    config = sw.load_config(overrides={**overrides, "run_dir": "runs/own-model"})
    return sw.Trainer.build(config, model=model, dataset=data, loss=loss).fit(show_progress=False)


if __name__ == "__main__":
    for summary in filter(None, sw.launch(main, nproc=2)):  # under torchrun: this rank's only
        print(f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}")

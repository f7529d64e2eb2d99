"""A custom training loop on gem's parts: compose a config, build data, model and optimizers, train a
few steps, evaluate.

    python examples/custom_loop.py                          # the tiny debug run: DLRM, synthetic data, CPU
    python examples/custom_loop.py model=gem_tiny steps=50  # any Hydra override of configs/train.yaml

Everything the trainer adds on top (logging, checkpoints, the sparse-dist pipeline, profiling) is
left out: this is the smallest loop that trains the same model on the same data as
``python -m gem.train``. ``steps=N`` (not a config key) sets the number of steps.
"""

from __future__ import annotations

import sys
import time

import gem


def main(argv: list[str]) -> dict[str, float]:
    steps = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("steps=")), 30)
    overrides = [a for a in argv if not a.startswith("steps=")]
    cfg = gem.compose(["debug=tiny", *overrides])  # configs/debug/tiny.yaml: 2,000 examples, batches of 64
    data = gem.build_data(cfg)  # validates the config, picks the device, generates the data set once
    model = gem.build_model(data)
    opt = gem.build_optimizers(model, data, total_steps=steps)
    print(f"{data.schema.tasks} on {data.device}, {steps} steps of {data.config.data.batch_size}")

    tick, step, losses = time.perf_counter(), 0, []
    while step < steps:
        for batch in data.loader("train"):  # one epoch of gem.data.Batch
            batch = batch.to(data.device, non_blocking=True)
            opt.zero_grad()
            loss, per_task = data.loss(model(batch), batch)  # masked multi-task BCE, trainer.task_weights
            loss.backward()
            opt.step()  # AdamW, the tables' Adagrad (fused tables got theirs in backward), the LR schedule
            losses.append(loss.item())
            step += 1
            if step % 10 == 0 or step == steps:
                print(f"step {step} loss {sum(losses[-10:]) / len(losses[-10:]):.4f} lr {opt.lr:.2e}")
            if step == steps:
                break
    metrics = gem.evaluate(model, data, "val")
    print(
        f"{steps} steps in {time.perf_counter() - tick:.1f}s; val "
        + " ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.endswith(("/auc", "/ne")))
    )
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
    import torch.distributed as dist

    if dist.is_initialized():  # build_data started a one-rank group for TorchRec's sharded tables
        dist.destroy_process_group()
